"""The build fallback learns the class of a failure: when TensorRT fails the same way on many nodes,
the bisection finds one, and every node of its kind runs in ONNX Runtime after one re-plan (real TensorRT-RTX builds)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.conftest import model_conf
from tests.flows.test_build_flow import build

N = 12


def make_int8_constants_model(path: Path, matmul: bool = False) -> Path:
    """x[n, 16] -> (+ Cast(c_i) -> Relu) x N: each c_i an int8 constant cast to float and added (no scale: not a
    quantized weight, so nothing rewrites it). TensorRT parses it and its builder refuses every one of them
    ("Quantized constant (c_i) is only allowed before DQ ...")."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits, nodes, cur = [], [], "x"
    if matmul:  # a layer to quantize in front: x @ w
        inits.append(numpy_helper.from_array((rng.standard_normal((16, 16)) * 0.3).astype(np.float32), "w"))
        nodes.append(helper.make_node("MatMul", ["x", "w"], ["xw"], name="matmul"))
        cur = "xw"
    for i in range(N):
        inits.append(numpy_helper.from_array(rng.integers(-3, 4, (16,)).astype(np.int8), f"c{i}"))
        nodes += [helper.make_node("Cast", [f"c{i}"], [f"f{i}"], to=TensorProto.FLOAT, name=f"cast{i}"),
                  helper.make_node("Add", [cur, f"f{i}"], [f"a{i}"], name=f"add{i}"),
                  helper.make_node("Relu", [f"a{i}"], [f"r{i}"], name=f"relu{i}")]
        cur = f"r{i}"
    g = helper.make_graph(nodes, "consts", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                          [helper.make_tensor_value_info(cur, TensorProto.FLOAT, ["n", 16])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def test_a_failure_many_nodes_share_is_excluded_by_kind_in_one_replan(prefect_harness, tmp_path):
    d = model_conf(tmp_path, "consts", make_int8_constants_model(tmp_path / "consts.onnx"),
                   "x: {min: [1, 16], opt: [4, 16], max: [8, 16]}")
    s = build(["model=consts", "precision=fp16", "stages.benchmark=false"], d, tmp_path / "a")
    assert s["status"] == "ok", s.get("error")
    note = s["stages"]["partition"]["note"]
    assert note.count("re-planned") == 1, note  # one re-plan, not one per node
    assert f"with the {N - 1} other Cast nodes reading int8 initializers" in note and "Quantized constant" in note
    plan = json.loads((Path(s["out_dir"]) / "partition.json").read_text())
    native = [f for f in plan["fallback_nodes"]]
    assert sorted(f["name"] for f in native) == sorted(f"cast{i}" for i in range(N))
    assert s["metrics"]["trt_subgraphs"] == 1 and s["metrics"]["cosine_min"] > 0.999


def test_a_builder_error_after_the_fallback_says_the_fix_that_matches_its_cause(prefect_harness, tmp_path):
    """With the fallback off, the builder's words once and the fix for an 8-bit constant read by another op (not the
    profiles), and no TensorRT log lines."""
    d = model_conf(tmp_path, "consts", make_int8_constants_model(tmp_path / "consts.onnx"),
                   "x: {min: [1, 16], opt: [4, 16], max: [8, 16]}")
    s = build(["model=consts", "precision=fp16", "stages.benchmark=false", "partition.build_fallback=false"], d,
              tmp_path / "b")
    assert s["status"] == "failed"
    err = s["error"]
    assert err.count("is only allowed before DQ") == 1, err
    assert "DequantizeLinear" in err and "partition.exclude_ops=[Cast]" in err and "profiles" not in err, err
    assert "cudaError" not in err and "[TRT]" not in err


def test_an_int8_engine_tensorrt_cannot_build_is_re_planned_in_calibrate(prefect_harness, tmp_path):
    """int8 on a host without a GPU builds no fp16 baseline engine: calibrate's own engine build finds what TensorRT
    cannot build, re-plans (every Cast of an int8 constant to ONNX Runtime, at once) and calibrates the new plan."""
    d = model_conf(tmp_path, "consts", make_int8_constants_model(tmp_path / "consts.onnx", matmul=True),
                   "x: {min: [1, 16], opt: [4, 16], max: [8, 16]}")
    np.savez(tmp_path / "cal.npz", x=np.random.default_rng(1).standard_normal((16, 1, 16)).astype(np.float32))
    s = build(["model=consts", "precision=int8", "stages.benchmark=false", f"calibration.data={tmp_path / 'cal.npz'}"],
              d, tmp_path / "c")
    assert s["status"] == "ok", s.get("error")
    assert s["stages"]["build"]["status"] == "skipped" and s["stages"]["calibrate"]["status"] == "ok"
    note = s["stages"]["partition"]["note"]
    assert note.count("re-planned") == 1 and "Quantized constant" in note, note
    plan = json.loads((Path(s["out_dir"]) / "partition.json").read_text())
    assert sorted(f["name"] for f in plan["fallback_nodes"]) == sorted(f"cast{i}" for i in range(N))
    assert s["metrics"]["quantized_layers"] == 1 and s["metrics"]["cosine_min"] >= 0.99, s["metrics"]
