"""tasks.onnxrt.staged.StagedSession: a graph run as a few real ONNX Runtime sessions in sequence, cut only where fp16
roundings (Cast pairs) cross, gives exactly what one session of the whole graph gives; a run whose early inputs (a
feed, the switches of the first stages) repeat an earlier run's starts at a later stage."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tasks.onnxrt.ort import ort_run, ort_session
from tasks.onnxrt.staged import StagedSession

BLOCKS = 6


def _model(rounded: bool = True) -> onnx.ModelProto:
    """BLOCKS blocks of Conv -> (fp16 rounding) -> If(flag_i: x * 1.37, else x * 0.71) -> (rounding), a skip Add from
    block 1 to block 4: what the search's switchable graph is made of (its switches are Ifs, its remainder rounded)."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []
    v = "x"

    def rounding(v: str, tag: str) -> str:
        if not rounded:
            return v
        nodes.append(helper.make_node("Cast", [v], [f"{tag}_h"], to=TensorProto.FLOAT16, name=f"{tag}_round"))
        nodes.append(helper.make_node("Cast", [f"{tag}_h"], [f"{tag}_r"], to=TensorProto.FLOAT, name=f"{tag}_back"))
        return f"{tag}_r"

    for i in range(BLOCKS):
        inits.append(numpy_helper.from_array((rng.standard_normal((4, 4, 3, 3)) * 0.4).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("Conv", [v, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1], name=f"conv{i}"))
        c = rounding(f"c{i}", f"c{i}")
        branches = []
        for side, k in (("then", 1.37), ("else", 0.71)):
            inits.append(numpy_helper.from_array(np.array(k, np.float32), f"k{i}{side}"))
            branches.append(helper.make_graph([helper.make_node("Mul", [c, f"k{i}{side}"], [f"s{i}{side}"])],
                                              f"b{i}{side}", [], [helper.make_tensor_value_info(f"s{i}{side}",
                                                                                                TensorProto.FLOAT, None)]))
        nodes.append(helper.make_node("If", [f"flag{i}"], [f"s{i}"], then_branch=branches[0], else_branch=branches[1],
                                      name=f"switch{i}"))
        v = rounding(f"s{i}", f"s{i}")
        if i == 4:
            nodes.append(helper.make_node("Add", [v, "s1_r" if rounded else "s1"], ["skip"], name="skip"))
            v = rounding("skip", "skip")
    nodes.append(helper.make_node("Identity", [v], ["y"], name="out"))
    graph = helper.make_graph(nodes, "staged",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16]),
                               *(helper.make_tensor_value_info(f"flag{i}", TensorProto.BOOL, []) for i in range(BLOCKS))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    m.ir_version = 9
    onnx.checker.check_model(m)
    return m


WEIGHT = {f"conv{i}": 1.0 for i in range(BLOCKS)}


def _inputs(x, flags):
    return {"x": x, **{f"flag{i}": np.array(bool(f)) for i, f in enumerate(flags)}}


def test_a_staged_run_is_the_whole_graphs_run_and_starts_where_it_parts_from_an_earlier_one():
    m = _model()
    whole = ort_session(m.SerializeToString(), optimization="basic")
    staged = StagedSession(m, stages=3, weight=WEIGHT, stage="calibrate")
    assert len(staged.sessions) == 3  # cut at a third and two thirds of the convolutions
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((1, 4, 16, 16)).astype(np.float32) for _ in range(2)]
    base = [1, 0, 1, 1, 0, 0]
    want = ort_run(whole, _inputs(xs[0], base))["y"]
    assert np.array_equal(staged.run(_inputs(xs[0], base))["y"], want)
    assert staged.runs_from == [1, 0, 0]
    stage_of = {n.name: k for k, (part, _, _) in enumerate(staged.parts) for n in part.graph.node}
    for i in range(BLOCKS):  # the screen: one switch flipped on top of the base, same feed
        flipped = [f ^ (k == i) for k, f in enumerate(base)]
        starts = list(staged.runs_from)
        got = staged.run(_inputs(xs[0], flipped))["y"]
        want = ort_run(whole, _inputs(xs[0], flipped))["y"]
        assert np.array_equal(got, want), i  # bit for bit
        assert not np.array_equal(got, ort_run(whole, _inputs(xs[0], base))["y"])  # the switch changes the output
        starts[stage_of[f"switch{i}"]] += 1  # from the stage of the switch flipped: the base's values before it
        assert staged.runs_from == starts, i
    assert staged.runs_from[0] < 1 + BLOCKS // 2 and staged.runs_from[2] > 0
    # another feed with the same flags: nothing of the first feed's is reused
    before = list(staged.runs_from)
    assert np.array_equal(staged.run(_inputs(xs[1], base))["y"], ort_run(whole, _inputs(xs[1], base))["y"])
    assert staged.runs_from[0] == before[0] + 1


def test_only_cast_outputs_cross_a_cut_and_nothing_is_kept_beyond_the_bound():
    plain = StagedSession(_model(rounded=False), stages=3, weight=WEIGHT, stage="calibrate")
    assert len(plain.sessions) == 1  # no rounding to cut at: one session
    m = _model()
    tiny = StagedSession(m, stages=3, weight=WEIGHT, stage="calibrate", cache_bytes=100)
    x = np.ones((1, 4, 16, 16), np.float32)
    for _ in range(3):
        tiny.run(_inputs(x, [0] * BLOCKS))
    assert tiny.runs_from == [3, 0, 0] and not tiny._cache  # a cut's values (1 KiB) exceed the bound: not kept
