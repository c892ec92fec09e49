"""Non-finite values in the comparison (tasks/accuracy/metrics.py ``finite_part``): NaN/inf at the same places in the
reference and the candidate are left out and the finite rest compared; non-finite in one of them only is a mismatch;
finite outputs give the figures of the plain formula."""
from __future__ import annotations

import numpy as np

from tasks.accuracy.metric import within_tolerance
from tasks.accuracy.metrics import compare, cosine, pooled_estimate, pooled_sums, summarize


def _plain(a: np.ndarray, b: np.ndarray) -> dict:
    """The formula of finite outputs, written out: what compare gave before non-finite values were handled."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    diff = np.abs(a - b)
    return {"cosine": float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))), "max_abs": float(diff.max()),
            "mean_abs": float(diff.mean()), "ref_max_abs": float(np.abs(a).max()), "_dot": float(a @ b),
            "_na2": float(a @ a), "_nb2": float(b @ b), "_abs_sum": float(diff.sum()), "_n": int(diff.size)}


def test_finite_outputs_give_the_plain_formula_bit_for_bit():
    rng = np.random.default_rng(3)
    for _ in range(50):
        shape = tuple(rng.integers(1, 7, size=rng.integers(1, 4)))
        ref = rng.standard_normal(shape).astype(np.float32)
        got = ref + rng.standard_normal(shape).astype(np.float32) * 0.05
        assert compare({"y": ref}, {"y": got})["y"] == _plain(ref, got)
        assert cosine(ref, got) == _plain(ref, got)["cosine"]
        assert pooled_sums({"y": ref}, {"y": got})["y"] == tuple(_plain(ref, got)[k] for k in ("_dot", "_na2", "_nb2"))


def test_same_place_nonfinite_values_are_left_out_and_counted():
    ref = np.array([1.0, np.nan, 2.0, np.inf, -np.inf, 3.0], np.float32)
    got = np.array([1.1, np.nan, 2.0, np.inf, -np.inf, 3.0], np.float32)
    m = compare({"y": ref}, {"y": got})["y"]
    plain = _plain(ref[[0, 2, 5]], got[[0, 2, 5]])
    assert m["cosine"] == plain["cosine"] and m["max_abs"] == plain["max_abs"] and m["mean_abs"] == plain["mean_abs"]
    assert (m["nonfinite_both"], m["nonfinite_mismatch"], m["elements"]) == (3, 0, 6)
    assert cosine(ref, got) == plain["cosine"]
    assert pooled_sums({"y": ref}, {"y": got})["y"] == (plain["_dot"], plain["_na2"], plain["_nb2"])
    s = summarize([compare({"y": ref}, {"y": got}), compare({"y": ref[:3]}, {"y": got[:3]})])["y"]
    assert (s["nonfinite_both"], s["nonfinite_mismatch"], s["elements"]) == (4, 0, 9)
    assert 0.99 < s["cosine"] < 1.0
    assert within_tolerance(got, ref, 0.2, 0.0).all()


def test_nonfinite_in_one_only_or_of_another_class_is_a_mismatch():
    ref = np.array([1.0, np.nan, 2.0, np.inf], np.float32)
    for got in (np.array([1.0, 5.0, 2.0, np.inf], np.float32),  # the reference's NaN, a value in the candidate
                np.array([np.nan, np.nan, 2.0, np.inf], np.float32),  # a NaN the reference does not have
                np.array([1.0, np.nan, 2.0, -np.inf], np.float32)):  # +inf against -inf
        m = compare({"y": ref}, {"y": got})["y"]
        assert m["cosine"] == 0.0 and m["max_abs"] == float("inf") and m["nonfinite_mismatch"] == 1
        assert cosine(ref, got) == 0.0
        assert pooled_estimate([pooled_sums({"y": ref}, {"y": got})])[0] == 0.0
        assert not within_tolerance(got, ref, 1e3, 0.0).all()
