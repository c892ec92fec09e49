"""The search's switchable session (tasks.quantization.sensitivity.Switchable) made cheaper without computing anything
else: its switches are If nodes whose quantizing branch holds the layer's Q/DQ, and the fp16 rounding of values that ops
only select (Where, Relu, Clip, Concat, ...) is left out. It must still score exactly the graph that is written."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tasks.onnxrt.emulate import precision_runner
from tasks.onnxrt.ort import ort_runner
from tasks.quantization.qdq import Quantizer
from tasks.quantization.ranges import ranges_from_feeds


def _model(path):
    """Conv -> Relu -> Conv -> Clip, a residual Add of the two branches, Concat, a 1x1 Conv: what the rounding and
    switch rewrites meet in CNNs like PP-OCRv4 det (HardSwish's Clip, ReLU, residual adds, FPN concats)."""
    rng = np.random.default_rng(0)
    w = {f"w{i}": numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), f"w{i}")
         for i, s in enumerate([(8, 3, 3, 3), (8, 8, 3, 3), (4, 16, 1, 1)])}
    lo = numpy_helper.from_array(np.array(0.0, np.float32), "lo")
    hi = numpy_helper.from_array(np.array(2.5, np.float32), "hi")
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1], name="conv0"),
             helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
             helper.make_node("Conv", ["r0", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Clip", ["c1", "lo", "hi"], ["k1"], name="clip1"),
             helper.make_node("Add", ["k1", "r0"], ["a1"], name="add1"),
             helper.make_node("Concat", ["a1", "r0"], ["cat"], axis=1, name="cat"),
             helper.make_node("Conv", ["cat", "w2"], ["y"], name="conv2")]
    graph = helper.make_graph(nodes, "switch", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 12, 12])],
                              [*w.values(), lo, hi])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    m.ir_version = 9
    onnx.save(m, str(path))
    return path


@pytest.mark.parametrize("high", ["fp16", "fp32"])
def test_the_switchable_session_computes_the_written_graph(tmp_path, high):
    from tasks.quantization.sensitivity import Switchable

    path = _model(tmp_path / "m.onnx")
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((1, 3, 12, 12)).astype(np.float32) * s} for s in (1.0, 3.0)]
    ranges, _ = ranges_from_feeds(path, feeds, "minmax", tmp_path)
    q = Quantizer(path, ranges, "int8", high)
    run = ort_runner(path)
    s = Switchable(q, feeds, [run(f) for f in feeds])
    g = s.model.graph
    ops = [n.op_type for n in g.node]
    assert "Where" not in ops and ops.count("If") >= len(s.layers)  # one switch per quantized input
    inside = [x.op_type for n in g.node if n.op_type == "If" for a in n.attribute if a.name == "then_branch"
              for x in a.g.node]
    assert "QuantizeLinear" in inside  # a layer's activation Q/DQ runs only when the layer is quantized
    if high == "fp16":
        made = {o: n.op_type for n in g.node for o in n.output}
        rounded = [made.get(n.input[0]) for n in g.node if n.op_type == "Cast" and n.name.endswith("_round")]
        layers = {n.output[0] for n in g.node if n.name in s.layers}  # a quantizable layer: an If of its two forms
        assert layers and not {"Relu", "Clip", "Concat"} & set(rounded)
        assert layers <= {n.input[0] for n in g.node if n.op_type == "Cast" and n.name.endswith("_round")}
    assert s.layers == q.layers == ["conv0", "conv1", "conv2"]
    for names in ([], q.layers[:1], q.layers[1::2], q.layers):
        written = precision_runner(q.model(names))[0]
        for f in feeds:
            got, want = s._run(set(names), f)["y"], written(f)["y"]
            # the same ops on the same values: equal to float32 rounding of the output's scale
            assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), (high, names)
    full = precision_runner(q.model(q.layers))[0](feeds[1])["y"]
    assert np.abs(full - run(feeds[1])["y"]).max() > 1e-3  # and quantizing does change the output


def _model_with_if(path):
    """Conv -> Relu, and an If whose branches read the Relu's output from the outer scope (as Silero VAD's decoder reads
    its encoder's), then a Conv: the Relu's fp16 rounding, left out of the switchable graph, must not leave the
    branches reading a value nothing makes."""
    rng = np.random.default_rng(0)
    w0 = numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32), "w0")
    w1 = numpy_helper.from_array((rng.standard_normal((4, 8, 1, 1)) * 0.3).astype(np.float32), "w1")
    half = numpy_helper.from_array(np.array(0.5, np.float32), "half")
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    r0 = helper.make_tensor_value_info("r0", TensorProto.FLOAT, [1, 8, 12, 12])
    then = helper.make_graph([helper.make_node("Identity", ["r0"], ["t"], name="then_id")], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, 8, 12, 12])])
    other = helper.make_graph([helper.make_node("Mul", ["r0", "half"], ["e"], name="else_mul")], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1, 8, 12, 12])])
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1], name="conv0"),
             helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
             helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0, name="sum"),
             helper.make_node("Greater", ["total", "zero"], ["cond"], name="cond"),
             helper.make_node("If", ["cond"], ["picked"], then_branch=then, else_branch=other, name="pick"),
             helper.make_node("Conv", ["picked", "w1"], ["y"], name="conv1")]
    graph = helper.make_graph(nodes, "with_if", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 12, 12])],
                              [w0, w1, half, zero], value_info=[r0])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def test_a_branch_reading_a_selected_value_from_outside_reads_it_in_the_switchable_graph(tmp_path):
    from tasks.quantization.sensitivity import Switchable

    path = _model_with_if(tmp_path / "m.onnx")
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((1, 3, 12, 12)).astype(np.float32) + m} for m in (0.5, -0.5)]  # both branches
    ranges, _ = ranges_from_feeds(path, feeds, "minmax", tmp_path)
    q = Quantizer(path, ranges, "int8", "fp16")
    run = ort_runner(path)
    s = Switchable(q, feeds, [run(f) for f in feeds])  # ONNX Runtime loads it
    assert s.layers == ["conv0", "conv1"]
    for names in ([], ["conv0"], ["conv0", "conv1"]):
        written = precision_runner(q.model(names))[0]
        for f in feeds:
            got, want = s._run(set(names), f)["y"], written(f)["y"]
            assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), names


@pytest.mark.parametrize("workers", [1, 2])
def test_a_judgement_refused_early_is_one_the_whole_set_refuses(workers):
    """meets_target stops running feeds once those run cannot reach the target whatever the rest gives (their error
    alone, against the standard error's floor): its verdict is always the full estimate's, and refusing takes fewer
    runs than the feeds. Feeds run two at a time give the same verdicts and figures."""
    from tasks.accuracy.metrics import pooled_estimate, pooled_sums
    from tasks.search.judging import meets_target, output_norms

    rng = np.random.default_rng(0)
    refs = [{"y": rng.standard_normal(64) * (1 + k % 3)} for k in range(12)]
    early = 0
    for trial in range(300):
        noise = rng.uniform(0.0, 0.3) * rng.uniform(0, 1, 12) ** 3
        outs = [{"y": r["y"] + n * rng.standard_normal(64) * np.abs(r["y"]).mean()} for r, n in zip(refs, noise)]
        bound = pooled_estimate([pooled_sums(r, o) for r, o in zip(refs, outs)], 1.0)[2]
        for target in (bound - 1e-4, bound + 1e-4, rng.uniform(0.95, 1.0)):
            ran = []
            ok, last = meets_target(lambda f: (ran.append(1), outs[f["k"]])[1], [{"k": k} for k in range(12)], refs,
                                    target, {}, output_norms(refs), 1.0, workers=workers)
            assert ok == (bound >= target), (trial, bound, target)
            if ok:  # met: every feed ran, and the figure is the whole set's, summed in order
                assert last is not None and last[2] == bound, (trial, last, bound)
            elif last is not None:  # refused after the last feed: the same figure
                assert last[2] == bound, (trial, last, bound)
            early += len(ran) < 12
    assert early > 100


def test_a_subset_judged_again_runs_only_the_feeds_it_has_not_run(tmp_path):
    """Every layer quantized is judged against the budget, then raced against other ranges: the feeds the first
    judgement ran are not run again, and each verdict is the one the whole set gives."""
    from tasks.quantization.sensitivity import Switchable

    path = _model(tmp_path / "m.onnx")
    rng = np.random.default_rng(2)
    feeds = [{"x": rng.standard_normal((1, 3, 12, 12)).astype(np.float32) * s} for s in (1.0, 3.0, 0.5, 2.0, 1.5)]
    ranges, _ = ranges_from_feeds(path, feeds, "minmax", tmp_path)
    q = Quantizer(path, ranges, "int8", "fp32")
    run = ort_runner(path)
    refs = [run(f) for f in feeds]
    figure = Switchable(q, feeds, refs).estimate(q.layers)  # every feed: the subset's figure
    s = Switchable(q, feeds, refs)
    assert not s.meets(q.layers, 1.0, again=True) and 0 < s.runs < len(feeds)  # refused after some feeds
    assert s.meets(q.layers, figure[2] - 1e-9)  # met: every feed counted, only the others run
    assert s.runs == len(feeds) and s.last == pytest.approx(figure, rel=1e-9, abs=1e-12)
    assert not s.meets(q.layers, figure[2] + 1e-6) and s.runs == len(feeds)  # judged again: nothing left to run


def test_a_switchable_session_of_large_runs_runs_alone_without_an_arena(tmp_path, monkeypatch):
    """Past LARGE_RUN_BYTES (IS-Net at 1024x1024) the search's session runs one feed at a time on every core and
    without an arena (an idle session would keep its largest run's values while the ranges' other session runs):
    the same figures as the default session, which keeps its arena and runs two at a time."""
    import tasks.onnxrt.ort as ort
    from tasks.quantization.sensitivity import Switchable

    path = _model(tmp_path / "m.onnx")
    rng = np.random.default_rng(5)
    feeds = [{"x": rng.standard_normal((1, 3, 12, 12)).astype(np.float32) * s} for s in (1.0, 3.0, 0.5)]
    ranges, _ = ranges_from_feeds(path, feeds, "minmax", tmp_path)
    q = Quantizer(path, ranges, "int8", "fp32")
    run = ort_runner(path)
    refs = [run(f) for f in feeds]
    small = Switchable(q, feeds, refs)
    assert small.session.get_session_options().enable_cpu_mem_arena
    monkeypatch.setattr(ort, "LARGE_RUN_BYTES", 0)
    large = Switchable(q, feeds, refs)
    assert not large.session.get_session_options().enable_cpu_mem_arena and large.workers == 1
    assert large.estimate(q.layers) == small.estimate(q.layers)


def test_the_screen_runs_several_subsets_at_once_with_the_figures_of_each_alone(tmp_path):
    """Switchable.cosines_each (the search's screen: one run per candidate on one page) runs the subsets' runs two at
    a time and gives each subset's cosines as cosines() of it alone; the subsets differ."""
    from tasks.quantization.sensitivity import Switchable

    path = _model(tmp_path / "m.onnx")
    rng = np.random.default_rng(3)
    feeds = [{"x": rng.standard_normal((1, 3, 12, 12)).astype(np.float32) * s} for s in (1.0, 3.0)]
    ranges, _ = ranges_from_feeds(path, feeds, "minmax", tmp_path)
    q = Quantizer(path, ranges, "int8", "fp32")
    run = ort_runner(path)
    refs = [run(f) for f in feeds]
    s = Switchable(q, feeds, refs)
    subsets = [[], q.layers[:1], q.layers[1:], q.layers]
    together = s.cosines_each(subsets, feeds, refs)
    assert together == [s.cosines(names, feeds, refs) for names in subsets]
    assert min(together[0]) > 1 - 1e-6 and all(max(c) < 1 - 1e-6 for c in together[1:])  # quantizing costs
    assert together[1] != together[2]  # each subset its own runs


def test_a_quantized_value_that_is_also_a_graph_output_is_probed_and_searched(tmp_path, monkeypatch):
    """A segment whose boundary value is also a quantized layer's input (a LayerNorm output that leaves the segment and
    feeds a MatMul in it, as in CAUSTIC PaiNN): ONNX Runtime's quantizer renames the value's producer output to
    ``<name>_QuantizeLinear_Input``. The ranges chosen by local error probe it under the fp32 model's name, and the
    written graph keeps both outputs."""
    from tasks.quantization.calibrate import qdq_from_onnx

    rng = np.random.default_rng(1)
    w = [numpy_helper.from_array((rng.standard_normal((16, 16)) * 0.25).astype(np.float32), f"w{i}") for i in range(3)]
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["a"], name="mm0"),
             helper.make_node("Relu", ["a"], ["t"], name="relu"),
             helper.make_node("MatMul", ["t", "w1"], ["b"], name="mm1"),
             helper.make_node("Tanh", ["b"], ["c"], name="tanh"),
             helper.make_node("MatMul", ["c", "w2"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "boundary", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 16]),
                               helper.make_tensor_value_info("t", TensorProto.FLOAT, [8, 16])], w)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    onnx.save(m, str(tmp_path / "m.onnx"))
    feeds = [{"x": rng.standard_normal((8, 16)).astype(np.float32)} for _ in range(12)]
    # a target every layer int8 misses (0.99978 less its error) and one layer alone meets (0.99989): the search runs
    # and chooses ranges by local error
    r = qdq_from_onnx(tmp_path / "m.onnx", feeds[:6], tmp_path / "q.onnx", min_cosine=0.99985, eval_feeds=feeds[6:],
                      workdir=tmp_path / "work")
    rows = {s["node"]: s for s in r.details["sensitivity"]}
    assert set(rows["mm1"]["local_errors"]) == {"entropy", "percentile", "minmax"}, rows  # probed through the renamed value
    q = onnx.load(str(tmp_path / "q.onnx"))
    assert [o.name for o in q.graph.output] == ["y", "t"]
    run = ort_runner(q.SerializeToString(), stage="test")
    ref = ort_runner(m.SerializeToString(), stage="test")
    got, want = run(feeds[0]), ref(feeds[0])
    assert r.metrics["quantized_layers"] >= 1, r.metrics
    for name in ("y", "t"):
        assert np.corrcoef(got[name].ravel(), want[name].ravel())[0, 1] > 0.999, name
    # a feed too large to hold with every method's outputs (IS-Net at 1024x1024): one feed and one method at a time,
    # each layer in a group of its own, the same local errors
    import tasks.onnxrt.ort as ort
    import tasks.quantization.sensitivity as sensitivity

    monkeypatch.setattr(sensitivity, "HELD_BYTES", 0)
    monkeypatch.setattr(ort, "LARGE_RUN_BYTES", 0)
    again = qdq_from_onnx(tmp_path / "m.onnx", feeds[:6], tmp_path / "q2.onnx", min_cosine=0.99985,
                          eval_feeds=feeds[6:], workdir=tmp_path / "work2")
    for row in again.details["sensitivity"]:
        for method, err in row["local_errors"].items():
            assert err == pytest.approx(rows[row["node"]]["local_errors"][method], rel=1e-6), (row["node"], method)


def test_captured_values_are_sized_before_they_are_held_and_captured_by_group(tmp_path):
    """The local errors size a feed's values from a run whose outputs are only their shapes (shape inference does not
    know IS-Net's), and capture a group of them by a session of its own: the same arrays as capturing all."""
    from tasks.quantization.sensitivity import _Capture, _measured_sizes

    path = _model(tmp_path / "m.onnx")
    m = onnx.load(str(path))
    names = ["x", *(n.output[0] for n in m.graph.node)]
    feed = {"x": np.random.default_rng(0).standard_normal((1, 3, 12, 12)).astype(np.float32)}
    every = _Capture(m, names)(feed)
    assert set(every) == set(names)
    assert _measured_sizes(m, names, feed) == {n: every[n].nbytes for n in names}
    group = names[1:3]
    part = _Capture(m, group)(feed)
    assert set(part) == set(group) and all(np.array_equal(part[n], every[n]) for n in group)


def test_layers_are_grouped_so_that_each_group_holds_at_most_the_limit():
    """Past HELD_BYTES the layers go in graph-ordered groups whose captured values and probed output fit the limit; a
    value two layers read counts once; a layer larger than the limit goes alone."""
    from tasks.quantization.sensitivity import _layer_groups

    q = helper.make_node("QuantizeLinear", ["a", "s", "z"], ["aq"], name="qa")
    dq = helper.make_node("DequantizeLinear", ["aq", "s", "z"], ["adq"], name="dqa")
    l1 = helper.make_node("Conv", ["adq", "w1"], ["b__quantized"], name="c1")
    l2 = helper.make_node("Conv", ["adq", "w2"], ["c__quantized"], name="c2")
    qb = helper.make_node("QuantizeLinear", ["c", "s", "z"], ["cq"], name="qc")
    dqb = helper.make_node("DequantizeLinear", ["cq", "s", "z"], ["cdq"], name="dqc")
    l3 = helper.make_node("Conv", ["cdq", "w3"], ["d__quantized"], name="c3")
    parts = {"entropy": ([q, dq, l1, l2, qb, dqb, l3], ["a", "c"], {"c1": "b", "c2": "c", "c3": "d"})}
    sizes = {"a": 100, "b": 10, "c": 10, "d": 500}
    # c1: a + b + b's probe = 120; c2 shares a: c + c's probe = 20 more; c3 reads c (held) and d twice: 1000
    assert _layer_groups(["c1", "c2", "c3"], parts, sizes, 140) == [["c1", "c2"], ["c3"]]
    # a new group captures again what the last one held: c2 alone is a + c + c's probe
    assert _layer_groups(["c1", "c2", "c3"], parts, sizes, 130) == [["c1"], ["c2"], ["c3"]]
    assert _layer_groups(["c1", "c2", "c3"], parts, sizes, 10_000) == [["c1", "c2", "c3"]]


def test_a_runs_bytes_are_those_of_every_value_it_computes(tmp_path):
    """run_bytes (the search runs its samples one at a time past LARGE_RUN_BYTES): the bytes of the inputs and every
    node's output at a feed's shapes, as a run gives them; shape inference and a run fetching shapes agree."""
    from tasks.quantization.sensitivity import _Capture, _measured_sizes, _value_sizes, run_bytes

    m = onnx.load(str(_model(tmp_path / "m.onnx")))
    feed = {"x": np.ones((1, 3, 12, 12), np.float32)}
    names = ["x", *(n.output[0] for n in m.graph.node)]
    every = _Capture(m, names)(feed)
    assert run_bytes(m, feed) == sum(a.nbytes for a in every.values()) > feed["x"].nbytes
    assert _value_sizes(m, names, feed) == _measured_sizes(m, names, feed)  # inferred here, measured alike


def test_the_written_graph_of_a_segment_with_a_boolean_output_takes_the_searchs_figure(tmp_path):
    """A TensorRT segment can hand a mask on to the rest of a model (Silero VAD half's decoder condition): the written
    graph is compared with the search's session on it by equality, not by a difference of booleans (TypeError)."""
    from tasks.quantization.layer_search import judged_as_written
    from tasks.quantization.sensitivity import Switchable

    m = onnx.load(str(_model(tmp_path / "base.onnx")))
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    m.graph.initializer.append(zero)
    m.graph.node.extend([helper.make_node("ReduceSum", ["y"], ["total"], keepdims=0, name="sum"),
                         helper.make_node("Greater", ["total", "zero"], ["positive"], name="positive")])
    m.graph.output.append(helper.make_tensor_value_info("positive", TensorProto.BOOL, []))
    path = tmp_path / "mask.onnx"
    onnx.save(m, str(path))
    rng = np.random.default_rng(3)
    feeds = [{"x": rng.standard_normal((1, 3, 12, 12)).astype(np.float32)} for _ in range(3)]
    ranges, _ = ranges_from_feeds(path, feeds, "minmax", tmp_path)
    q = Quantizer(path, ranges, "int8", "fp16")
    run = ort_runner(path)
    s = Switchable(q, feeds, [run(f) for f in feeds])
    chosen = q.layers[:2]
    assert s.meets(chosen, 0.5)  # judged on every feed: the search's figure of these layers
    judged = judged_as_written(q, chosen, s, feeds, held=len(feeds))
    assert judged is not None and judged.cosine == s.met[frozenset(chosen)][0][0]
