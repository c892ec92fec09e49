"""The search's margin derived from its rule (tasks/accuracy/budget.py): Student's t quantiles against printed tables,
how the margin moves with the held-out samples, the candidates and validation's samples, and the rule simulated: a
search that picks among its candidates on few samples, then validated on fresh ones."""
from __future__ import annotations

import numpy as np
import pytest

from tasks.accuracy.budget import (HELD_ALONE, JUDGE_CALIBRATION, MAX_MARGIN, SEARCH_ALPHA, derived_margin,
                                   judged_samples, student_t_quantile)
from tasks.quantization import judge_feeds_of


@pytest.mark.parametrize("p, df, table", [(0.95, 3, 2.353), (0.95, 7, 1.895), (0.975, 10, 2.228), (0.995, 7, 3.499),
                                          (0.999, 15, 3.733)])
def test_t_quantiles_match_the_printed_table(p, df, table):
    assert student_t_quantile(p, df) == pytest.approx(table, rel=0.01)


def test_the_margin_shrinks_with_evidence_and_grows_with_candidates():
    base = derived_margin(8, 16, 21, 8, 1.0)
    assert derived_margin(16, 24, 21, 8, 1.0) < base < derived_margin(4, 12, 21, 8, 1.0)
    assert derived_margin(8, 16, 12, 8, 1.0) < base < derived_margin(8, 16, 100, 8, 1.0)
    assert derived_margin(8, 16, 21, 64, 1.0) < base < derived_margin(8, 16, 21, 3, 1.0)
    assert derived_margin(16, 24, 21, 16, 1.0) == pytest.approx(0.533, abs=0.002)
    assert derived_margin(2, 10, 21, 2, 1.0) == MAX_MARGIN  # two held-out samples support no figure


def _search(rng, true_error: float, n: int, k: int, m: int, budget_error: float = 0.01):
    """k candidates of the same true error judged on n samples each (per-sample errors exponential: their spread as
    large as their mean, the standard error's floor), met by the search's test (pooled error plus one standard error
    within (1 - margin) of the allowed error); (whether one was kept, whether a kept one fails validation on m fresh
    samples)."""
    margin = derived_margin(n, n, k, m, 1.0)
    x = rng.exponential(1.0, size=(k, n)) * true_error
    est = x.mean(1)
    se = np.maximum(x.std(1, ddof=1) / np.sqrt(n), est / np.sqrt(n))
    kept = est + se <= (1 - margin) * budget_error
    fresh = rng.exponential(1.0, size=(k, m)).mean(1) * true_error
    return bool(kept.any()), bool((kept & (fresh > budget_error)).any())


@pytest.mark.parametrize("n", [3, 4, 8, 16])
def test_a_kept_graph_fails_validation_at_most_as_often_as_the_rule_allows(n):
    """Candidates whose true error is the whole budget or 60% of it: the search keeps one and validation then fails it
    in at most SEARCH_ALPHA of the searches (with the normal quantile instead of Student's, n = 4 failed 11%); at a
    third of the budget, 8 or more held-out samples keep a candidate nearly always."""
    rng = np.random.default_rng(0)
    for true_error in (0.01, 0.006):
        runs = [_search(rng, true_error, n, 21, n) for _ in range(1500)]
        assert np.mean([f for _, f in runs]) <= SEARCH_ALPHA, (n, true_error)
    if n >= 8:
        assert np.mean([k for k, _ in (_search(rng, 0.003, n, 21, n) for _ in range(500))]) >= 0.95


def test_enough_held_out_samples_judge_the_search_alone():
    """From HELD_ALONE held-out samples the search judges them alone, as the rule above is simulated (the calibration
    samples chose the ranges: in-sample, no evidence); fewer are judged with up to JUDGE_CALIBRATION calibration
    samples; none held out, the calibration samples judge. The count the margin is derived from is what is judged."""
    cal = [{"x": np.full((1, 2), i, np.float32)} for i in range(12)]
    held = [{"x": np.full((1, 2), 100 + i, np.float32)} for i in range(HELD_ALONE)]
    assert judge_feeds_of(cal, held) == held
    assert judged_samples(HELD_ALONE, len(cal)) == HELD_ALONE
    few = held[:HELD_ALONE - 1]
    assert judge_feeds_of(cal, few) == few + cal[:JUDGE_CALIBRATION]
    assert judged_samples(len(few), len(cal)) == len(few) + JUDGE_CALIBRATION
    assert judge_feeds_of(cal, None) == cal and judged_samples(0, len(cal)) == len(cal)
    # decided on the held-out feeds as the search picks them: 3 feeds of 4 samples each are 3 feeds
    assert judged_samples(12, len(cal), held_feeds=3) == 12 + JUDGE_CALIBRATION
