"""Profiles from traffic: a realistic record for the default det model (document pages from phones and scanners,
batches 1..4, a few odd requests), read and checked against the real PP-OCRv4 det graph; bad records refused."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.traffic_data import document_traffic
from tasks.common.errors import ConfigError
from tasks.graph.models import TensorInfo
from tasks.data.proposal import propose
from tasks.data.proposal_report import write_profiles, yaml_fragment
from tasks.data.traffic import TrafficDraws, inside, read_traffic, serving

X = [TensorInfo("x", "float32", ["N", 3, "H", "W"])]


@pytest.fixture(scope="module")
def det():
    from tasks.graph.load import load_onnx
    from tasks.graph.models import graph_io, resolve_source

    model = load_onnx(resolve_source("pkg://rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"))
    return model, graph_io(model)[0]


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> Path:
    return document_traffic(tmp_path_factory.mktemp("traffic") / "requests.jsonl")


def test_profiles_from_document_traffic_cover_it_on_the_model_stride(det, record):
    model, inputs = det
    t = read_traffic(record, inputs)
    p = propose(t, model)
    assert p.requests == 20_009 and p.coverage >= 0.999
    assert 2 <= len(p.profiles) <= 4 and sum(p.per_profile) == p.covered
    # the odd ones are listed, not profiled: a batch of 16 thumbnails, a receipt strip
    odd = {(o["x"][0], o["x"][2], o["x"][3]) for o in p.outliers}
    assert (16, 128, 128) in odd and (1, 1920, 416) in odd
    shapes = [s["x"] for s in t.shapes]
    for prof in p.profiles:
        r = prof["x"]
        assert tuple(r["opt"]) in shapes  # opt is a real request: on the stride, the mix's weighted centre
        assert all(v % 32 == 0 for w in ("min", "opt", "max") for v in r[w][2:])
        assert all(lo <= o <= hi for lo, o, hi in zip(r["min"], r["opt"], r["max"]))
    # boxes never overlap: each request is served by the profile it was grouped in
    for a in range(len(p.profiles)):
        for b in range(a + 1, len(p.profiles)):
            ra, rb = p.profiles[a]["x"], p.profiles[b]["x"]
            assert any(ra["max"][d] < rb["min"][d] or rb["max"][d] < ra["min"][d] for d in range(4))
    assert list(p.objective) == sorted(p.objective) and p.objective[1] > p.objective[len(p.profiles)]
    assert p.opt_distance is not None and p.opt_distance < 0.2  # vs 0.33 log-distance for one profile
    assert all(a is not None and a > 0 for a in p.activation_mib)
    one = propose(t, model, k=1)
    assert len(one.profiles) == 1 and one.opt_distance > p.opt_distance


def test_an_activation_budget_leaves_out_what_cannot_fit(det, record):
    model, inputs = det
    t = read_traffic(record, inputs)
    free = propose(t, model)
    capped = propose(t, model, max_activation_mib=300.0)
    assert all(a <= 300.0 * 1.05 for a in capped.activation_mib)  # estimated on the way, exact at the end
    over = [o for o in capped.outliers if "max_activation_mib" in o["why"]]
    assert over and all(serving(capped.profiles, {"x": tuple(o["x"])}) is None for o in over)
    assert max(capped.activation_mib) < max(free.activation_mib)


def test_draws_follow_the_traffic_mix(record):
    t = read_traffic(record, X)
    prof = {"x": {"min": [1, 3, 32, 32], "opt": [1, 3, 960, 704], "max": [1, 3, 960, 960]}}
    draws = TrafficDraws(t).draw(prof, 400, np.random.default_rng(0))
    assert all(inside(prof, {"x": tuple(d["x"])}) for d in draws)
    batch1 = {tuple(s["x"]): c for s, c in zip(t.shapes, t.counts) if s["x"][0] == 1}
    top = max(batch1, key=batch1.get)
    share = sum(tuple(d["x"]) == top for d in draws) / len(draws)
    assert abs(share - batch1[top] / sum(batch1.values())) < 0.08  # weighted by count, not uniform
    single = TrafficDraws(t).draw_single(prof, 50, np.random.default_rng(1))
    assert all(d["x"][0] == 1 for d in single) and len({tuple(d["x"]) for d in single}) > 3


@pytest.mark.parametrize("lines, words", [
    ([], "holds no request"),
    (['{"x": [1, 3, 0, 64]}'], "dim 2 = 0"),
    (['{"x": [1, 3, -32, 64]}'], "dim 2 = -32"),
    (['{"y": [1, 3, 64, 64]}'], "no input 'y'"),
    (['{"x": [1, 3, 64]}'], "rank 3"),
    (['{"x": [1, 4, 64, 64]}'], "fixes it at 3"),
    (['{"x": [1, 3, 64, 64], "count": 0}'], "count=0"),
    (["not json"], "line 1 is not JSON"),
])
def test_bad_records_are_refused_with_the_line_and_the_fix(tmp_path, lines, words):
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as e:
        read_traffic(f, X)
    assert words in e.value.message and e.value.fix


def test_a_request_off_the_model_stride_is_refused(tmp_path):
    from tasks.data.profiles import ShapeRules
    from tasks.data.traffic import check_rules

    f = tmp_path / "t.jsonl"
    f.write_text('{"x": [1, 3, 720, 1280]}\n')
    with pytest.raises(ConfigError, match="720 is no multiple of 32"):
        check_rules(read_traffic(f, X), ShapeRules([], {"x": [1, 1, 32, 32]}))


def test_a_folder_of_requests_is_read_from_the_array_headers(tmp_path):
    for i, (h, w) in enumerate([(64, 96), (64, 96), (128, 64)]):
        np.savez(tmp_path / f"r{i}.npz", x=np.zeros((1, 3, h, w), np.float32))
    t = read_traffic(tmp_path, X)
    assert sorted(zip([s["x"] for s in t.shapes], t.counts)) == [((1, 3, 64, 96), 2), ((1, 3, 128, 64), 1)]


def test_the_profiles_go_into_the_model_yaml_and_nothing_else_moves(tmp_path):
    y = tmp_path / "m.yaml"
    y.write_text("# my model\nname: m\nprofiles:\n  - x: {min: [1, 3, 32, 32], opt: [1, 3, 64, 64], max: [1, 3, 64, 64]}\n"
                 "shape_multiple:\n  x: [1, 1, 32, 32]\n")
    prof = [{"x": {"min": [1, 3, 64, 64], "opt": [1, 3, 96, 96], "max": [2, 3, 128, 128]}}]
    write_profiles(y, prof)
    import yaml

    doc = yaml.safe_load(y.read_text())
    assert doc["profiles"] == prof and doc["shape_multiple"] == {"x": [1, 1, 32, 32]} and doc["name"] == "m"
    assert y.read_text().startswith("# my model\n") and yaml_fragment(prof) in y.read_text()
    assert serving(prof, {"x": (2, 3, 100, 128)}) == 0 and serving(prof, {"x": (3, 3, 100, 128)}) is None
