"""Shapes of a model's tensors for the partition (tasks/partition/segments.py tensor_shapes): read from ONNX Runtime's
profile of plain runs, so collecting every tensor's shape costs one run's working set, not every tensor at once."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from tasks.common.memory import MIB, MemoryWatch
from tasks.partition.segments import run_with_intermediates, shape_ranges, tensor_shapes

CHAIN = 40  # 40 tensors of 16 MiB at the largest feed: 640 MiB when all are alive at once


def chain_model():
    """x[n, t] -> 40 x (Add 1) -> NonZero(Greater(x, k)) (a data-dependent shape) and Split into two optional-free
    outputs; the chain's tensors are intermediates."""
    nodes, x = [], "x"
    for i in range(CHAIN):
        nodes.append(helper.make_node("Add", [x, "one"], [f"a{i}"]))
        x = f"a{i}"
    nodes += [helper.make_node("Greater", [x, "k"], ["mask"]), helper.make_node("NonZero", ["mask"], ["nz"]),
              helper.make_node("Split", [x], ["s0", "s1"], axis=1, num_outputs=2)]
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", T.FLOAT, ["n", "t"])],
                          [helper.make_tensor_value_info(o, T.FLOAT, None) for o in ("s0", "s1")] +
                          [helper.make_tensor_value_info("nz", T.INT64, None)],
                          [numpy_helper.from_array(np.ones((), np.float32), "one"),
                           numpy_helper.from_array(np.full((), CHAIN + 0.5, np.float32), "k")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_every_tensor_shape_from_the_profile_matches_exposing_them_in_a_fraction_of_the_memory():
    from tests.tasks.common.test_memory import in_a_fresh_process

    in_a_fresh_process("shapes_from_the_profile_in_a_fraction_of_the_memory", __name__)


def shapes_from_the_profile_in_a_fraction_of_the_memory():
    model = chain_model()
    rng = np.random.default_rng(0)
    feeds = [rng.standard_normal((n, t)).astype(np.float32) for n, t in ((1, 8), (2, 64), (4, 1 << 20))]
    feeds = [{"x": f} for f in feeds]
    names = ["x"] + [o for n in model.graph.node for o in n.output]

    w = MemoryWatch(None).start()
    try:
        base = _rss()
        with w.stage("profile"):
            shapes = tensor_shapes(model, names, feeds)
        with w.stage("exposed"):
            exposed = run_with_intermediates(model, names, feeds)
            exposed = [{n: (list(v.shape), str(v.dtype)) for n, v in r.items()} for r in exposed]
    finally:
        w.close()
    assert shapes == exposed  # every tensor, the data-dependent NonZero and both Split outputs included
    assert shapes[2]["a0"] == ([4, 1 << 20], "float32") and shapes[2]["nz"][1] == "int64"
    assert shapes[1]["mask"][1] == "bool"
    profiled, all_alive = w.stage_peaks["profile"] - base, w.stage_peaks["exposed"] - base
    assert all_alive > 500 * MIB, all_alive / MIB  # the way it was: every tensor alive until the run ends
    assert profiled < 200 * MIB, profiled / MIB

    r = shape_ranges(model, ["x", "a3", "nz"], feeds)
    assert r["a3"] == {"min": [1, 8], "opt": [2, 64], "max": [4, 1 << 20], "dtype": "float32"}
    assert r["nz"]["dtype"] == "int64" and r["nz"]["min"][0] == 2
