"""Calibration ranges from histograms of |x| (tasks/quantization/ranges.py)."""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tasks.quantization.qdq import quantized_activations
from tasks.quantization.ranges import ranges_from_feeds


def _two_convs(path):
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((2, 4, 1, 1)).astype(np.float32), "w2")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
             helper.make_node("Conv", ["r1", "w2"], ["y"], name="conv2")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 8, 8])], [w1, w2])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def test_histograms_only_where_q_dq_can_go_and_the_max_of_the_rest(tmp_path):
    """Every tensor ORT's calibrator records has a range; those a layer reads through Q/DQ come from their full
    histogram (entropy, percentile), the others (here the Conv outputs) are their max |x| over every sample."""
    path = _two_convs(tmp_path / "m.onnx")
    rng = np.random.default_rng(1)
    feeds = [{"x": (rng.standard_normal((1, 3, 8, 8)) * s).astype(np.float32)} for s in (1.0, 3.0)]
    needed = quantized_activations(path)
    assert needed == {"x", "r1"}
    import onnxruntime as ort

    m = onnx.load(str(path))
    m.graph.output.extend([onnx.ValueInfoProto(name="c1")])
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    c1_max = max(float(np.abs(sess.run(["c1"], f)[0]).max()) for f in feeds)
    x_max = max(float(np.abs(f["x"]).max()) for f in feeds)
    for method in ("entropy", "percentile"):
        r, _ = ranges_from_feeds(path, feeds, method, tmp_path)
        assert {"x", "r1", "c1", "y"} <= set(r.data), (method, sorted(r.data))
        assert float(r.data["c1"].range_value[1]) == np.float32(c1_max)  # the max of the rest
        assert len(r.data["x"].hist) >= 2048  # a full histogram of every sample, binned from 0
        assert 0 < float(r.data["x"].range_value[1]) <= x_max * (1 + 1e-6)


def _entropy_amax_loop(hist, edges) -> float:
    """TensorRT's entropy calibration as the reference loop over candidate thresholds (tasks/quantization/ranges.py computes every
    candidate at once from cumulative sums)."""
    import math

    from tasks.quantization.ranges import ENTROPY_CANDIDATES, ENTROPY_QUANT_BINS

    bins = np.asarray(hist, dtype=np.float64).copy()
    n, nq = bins.size, ENTROPY_QUANT_BINS
    if n <= nq or bins.sum() <= 0:
        return float(edges[-1])
    bins[0] = bins[1]
    tail = np.concatenate([np.cumsum(bins[::-1])[::-1], [0.0]])
    best_kl, best_i = math.inf, n
    for i in range(nq, n + 1, max(1, math.ceil((n - nq) / ENTROPY_CANDIDATES))):
        ref = bins[:i]
        p = ref.copy()
        p[-1] += tail[i]
        nz = ref != 0
        level = (np.arange(i) * nq) // i
        mass = np.bincount(level, weights=ref, minlength=nq)
        used = np.bincount(level, weights=nz, minlength=nq)
        q = np.where(nz, mass[level] / np.maximum(used[level], 1), 0.0)
        if p.sum() <= 0 or q.sum() <= 0:
            continue
        p, q = p / p.sum(), q / q.sum()
        m = p > 0
        kl = math.inf if (q[m] == 0).any() else float(np.sum(p[m] * np.log(p[m] / q[m])))
        if kl <= best_kl:
            best_kl, best_i = kl, i
    return float(edges[best_i])


def test_entropy_ranges_are_the_reference_loops(det_path, tmp_path):
    """The entropy threshold of every candidate at once equals the loop over candidates, on histograms of a real
    network's activations and on made-up ones (decaying, sparse, a plateau then a far outlier, a spike at zero)."""
    from tasks.quantization.ranges import _entropy_range

    rng = np.random.default_rng(0)
    feeds = [{"x": rng.uniform(-2, 2, (1, 3, 96, 96)).astype(np.float32)} for _ in range(2)]
    ranges, _ = ranges_from_feeds(det_path, feeds, "entropy", tmp_path)
    real = [(v.hist, v.bins) for v in ranges.data.values() if v.hist is not None and len(v.hist) > 1]
    assert len(real) >= 60
    made = []
    for t in range(120):
        n = int(rng.integers(129, 4200))
        h = [rng.poisson(1000 * np.exp(-np.arange(n) / rng.uniform(20, 800))),
             rng.poisson(50, n) * (rng.random(n) < 0.3),
             np.where(np.arange(n) < rng.integers(1, 200), 415, 0) + (np.arange(n) == n - 1) * 3,
             rng.poisson(5 * np.exp(-np.arange(n) / 50.0)) + (np.arange(n) == 0) * 100000][t % 4]
        made.append((h, np.linspace(0, rng.uniform(0.1, 50), n + 1).astype(np.float32)))
    for hist, edges in real + made:
        assert float(_entropy_range((hist, edges))[1]) == _entropy_amax_loop(hist, edges)


def test_feeds_whose_values_are_large_are_run_one_at_a_time_with_the_same_ranges(tmp_path, monkeypatch):
    """A feed whose calibrated values hold more than LARGE_RUN_BYTES (IS-Net at 1024x1024: 1.8 GiB) runs alone, on
    every core, without an arena: the histograms and ranges are those of feeds run two at a time."""
    import tasks.onnxrt.ort as ort
    import tasks.quantization.ranges as ranges

    path = _two_convs(tmp_path / "m.onnx")
    rng = np.random.default_rng(2)
    feeds = [{"x": (rng.standard_normal((1, 3, 8, 8)) * s).astype(np.float32)} for s in (1.0, 3.0, 0.5, 2.0)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    together, _ = ranges_from_feeds(path, feeds, "entropy", tmp_path / "a")
    ran = []
    made = ranges._calibration_run
    monkeypatch.setattr(ranges, "_calibration_run", lambda cal, threads, arena=True: ran.append(arena) or made(
        cal, threads, arena))
    monkeypatch.setattr(ort, "LARGE_RUN_BYTES", 0)
    monkeypatch.setattr(ranges, "_RANGES_MEMO", {})
    alone, _ = ranges_from_feeds(path, feeds, "entropy", tmp_path / "b")
    assert ran == [True, False]  # the first feed measured, the rest on a session without an arena
    assert set(alone.data) == set(together.data)
    for name, td in together.data.items():
        assert np.array_equal(alone.data[name].range_value, td.range_value), name
        assert np.array_equal(alone.data[name].hist, td.hist), name


def test_calibration_writes_nothing_beside_the_model(tmp_path):
    """ONNX Runtime's calibrator and quantizer write a shape-inferred copy beside the model they are given and delete it:
    two test workers calibrating one packaged model removed each other's copy mid-read. Here that copy's name is taken
    by a folder: calibrating and quantizing still work, and the folder beside the model is left as it was."""
    from tasks.quantization.qdq import Quantizer

    models = tmp_path / "models"
    models.mkdir()
    path = _two_convs(models / "m.onnx")
    (models / "m-inferred.onnx").mkdir()
    feeds = [{"x": np.random.default_rng(2).standard_normal((1, 3, 8, 8)).astype(np.float32)}]
    for method in ("entropy", "minmax"):
        (tmp_path / method).mkdir()
        r, _ = ranges_from_feeds(path, feeds, method, tmp_path / method)
        assert {"x", "r1"} <= set(r.data), method
    q = Quantizer(path, r, "int8", "fp32")
    assert {n.op_type for n in q.qdq(q.layers).graph.node} >= {"QuantizeLinear", "DequantizeLinear", "Conv"}
    assert sorted(p.name for p in models.iterdir()) == ["m-inferred.onnx", "m.onnx"]
    assert not any((models / "m-inferred.onnx").iterdir())


def test_calibration_prints_none_of_onnx_runtimes_warnings(tmp_path):
    """ONNX Runtime's calibrator makes a session of its own with the default logger: a model whose declared output
    shape disagrees with the graph (ddddocr's: [1, seqlen] for a 3-D value) made it print a warning on the user's
    console. Run in a fresh process: the default logger is per process."""
    import subprocess
    import sys
    from pathlib import Path

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "n"])], [w])  # declared 2-D
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(tmp_path / "m.onnx"))
    code = ("import numpy as np; from pathlib import Path; from tasks.quantization.ranges import ranges_from_feeds; "
            f"p = Path({str(tmp_path)!r}); feeds = [{{'x': np.ones((1, 3, 8, 8), np.float32)}}]; "
            "ranges_from_feeds(p / 'm.onnx', feeds, 'entropy', p); print('done')")
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[3], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "done" in r.stdout, r.stderr[-2000:]
    assert "onnxruntime" not in r.stderr, r.stderr[-2000:]
