"""Precision boundaries on tiny Q/DQ graphs built in code and parsed by the real TensorRT-RTX parser: a chain of three
convolutions with every one int8 against the middle one kept in float (two boundaries more, at hand-computed bytes);
the engine's own layer list where a GPU of the target is present."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tasks.trt.backend import Backend, gpu_for, no_gpu_reason
from tasks.trt.boundaries import reformats_from_engine_info
from tasks.trt.network import precision_profile_from_onnx

N, H, W, C = 2, 16, 24, 8
PROFILE = [{"x": {"min": [1, 3, 8, 8], "opt": [N, 3, H, W], "max": [4, 3, 32, 32]}}]


@pytest.fixture(scope="module")
def backend():
    return Backend("tensorrt_rtx")


def chain(path, quantized: set[str]):
    """x[N,3,H,W] fp32 -> conv1 -> Relu -> conv2 -> Relu -> conv3 -> y, each conv in ``quantized`` reading its input
    through QuantizeLinear/DequantizeLinear (int8, scale 0.05) and its weight through DequantizeLinear of int8 codes."""
    import onnx

    rng = np.random.default_rng(0)
    nodes, inits = [], [numpy_helper.from_array(np.array(0.05, np.float32), "s"),
                        numpy_helper.from_array(np.array(0, np.int8), "z")]
    src, cin = "x", 3
    for i in (1, 2, 3):
        name, cout = f"conv{i}", C if i < 3 else 4
        w = rng.standard_normal((cout, cin, 3, 3)).astype(np.float32) * 0.2
        if name in quantized:
            ws = np.abs(w).reshape(cout, -1).max(1) / 127
            inits += [numpy_helper.from_array(np.round(w / ws[:, None, None, None]).astype(np.int8), f"w{i}q"),
                      numpy_helper.from_array(ws.astype(np.float32), f"w{i}s"),
                      numpy_helper.from_array(np.zeros(cout, np.int8), f"w{i}z")]
            nodes += [helper.make_node("QuantizeLinear", [src, "s", "z"], [f"{src}_q"], name=f"{src}_Q"),
                      helper.make_node("DequantizeLinear", [f"{src}_q", "s", "z"], [f"{src}_dq"], name=f"{src}_DQ"),
                      helper.make_node("DequantizeLinear", [f"w{i}q", f"w{i}s", f"w{i}z"], [f"w{i}"], axis=0,
                                       name=f"w{i}_DQ")]
            data = f"{src}_dq"
        else:
            inits.append(numpy_helper.from_array(w, f"w{i}"))
            data = src
        out = "y" if i == 3 else f"c{i}"
        nodes.append(helper.make_node("Conv", [data, f"w{i}"], [out], pads=[1, 1, 1, 1], name=name))
        if i < 3:
            nodes.append(helper.make_node("Relu", [out], [f"r{i}"], name=f"relu{i}"))
            src, cin = f"r{i}", cout
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", "w"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, "h", "w"])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    m.ir_version = 9
    onnx.save(m, str(path))
    return path


def test_every_conv_int8_has_a_boundary_at_the_input_and_the_output(tmp_path, backend):
    """DQ -> conv -> Relu -> Q -> DQ -> conv ... is the fused pattern: only the graph's fp32 input and output cross."""
    p = precision_profile_from_onnx([chain(tmp_path / "all.onnx", {"conv1", "conv2", "conv3"})], [PROFILE], backend)
    b = {(x["from"], x["to"]): x for x in p["boundaries"]}
    assert set(b) == {("fp32", "int8"), ("int8", "fp32")}
    assert b[("fp32", "int8")]["tensor"] == "x" and b[("fp32", "int8")]["bytes"] == N * 3 * H * W * 4
    assert b[("int8", "fp32")]["tensor"] == "y" and b[("int8", "fp32")]["bytes"] == N * 4 * H * W * 4
    m = p["metrics"]
    assert m["network_reformat_layers"] == 2
    assert m["network_reformat_bytes"] == N * 3 * H * W * 4 + N * 4 * H * W * 4


def test_a_float_layer_between_int8_ones_adds_two_boundaries(tmp_path, backend):
    """conv2 kept fp32: conv1's output leaves int8 for it, and its own output is quantized for conv3 on its own."""
    p = precision_profile_from_onnx([chain(tmp_path / "mixed.onnx", {"conv1", "conv3"})], [PROFILE], backend)
    got = sorted((x["from"], x["to"], x["bytes"]) for x in p["boundaries"])
    mid = N * C * H * W * 4  # an fp32 [N, 8, H, W] tensor: conv1's output, conv2's output
    assert got == sorted([("fp32", "int8", N * 3 * H * W * 4), ("int8", "fp32", mid), ("fp32", "int8", mid),
                          ("int8", "fp32", N * 4 * H * W * 4)])
    assert p["metrics"]["network_reformat_layers"] == 4
    assert p["metrics"]["flops_share"]["fp32"] > 0  # conv2's FLOPs: the boundaries are reported beside them


def test_a_float_network_has_no_boundary_metrics(tmp_path, backend):
    p = precision_profile_from_onnx([chain(tmp_path / "fp32.onnx", set())], [PROFILE], backend)
    assert "network_reformat_layers" not in p["metrics"] and "boundaries" not in p


def test_a_build_reports_the_estimate_and_says_what_it_was_measured_on(tmp_path, backend):
    """On a host without a GPU of the target the build reports the network estimate and names why the engine's own
    layer list was not read."""
    from tasks.engines.build import precision_boundaries

    cc = "8.6"
    if gpu_for(cc):
        pytest.skip("a GPU of sm_86 is present: the engine's layer list is read (test_engine_layer_list_on_the_gpu)")
    prof = precision_profile_from_onnx([chain(tmp_path / "mixed.onnx", {"conv1", "conv3"})], [PROFILE], backend)
    m = precision_boundaries(prof["metrics"], [], cc, backend)
    assert m["reformat_layers"] == m["network_reformat_layers"] == 4
    assert m["reformat_bytes"] == m["network_reformat_bytes"]
    assert m["reformat_source"].startswith("estimate on the TensorRT network")
    assert no_gpu_reason(cc) in m["reformat_source"]
    assert "engine_reformat_layers" not in m


def test_reformats_are_read_from_the_inspectors_json():
    """The two forms IEngineInspector gives (TensorRT's documented JSON): names only, and the detailed layer list."""
    names = '{"Layers": ["conv1", "Reformatting CopyNode for Input Tensor 0 to conv1", "conv2"], "Bindings": ["x", "y"]}'
    assert reformats_from_engine_info(names) == {"reformat_layers": 1, "reformat_bytes": None}
    detailed = ('{"Layers": [{"Name": "r0", "LayerType": "Reformat", "Inputs": [{"Name": "x", "Dimensions": [2,3,16,24],'
                ' "Format/Datatype": "Row major linear FP32"}], "Outputs": [{"Name": "x2", "Dimensions": [2,3,16,24],'
                ' "Format/Datatype": "Channel major FP16 format where channel % 8 == 0"}]},'
                ' {"Name": "conv1", "LayerType": "CaskConvolution", "Inputs": [], "Outputs": []}]}')
    assert reformats_from_engine_info(detailed) == {"reformat_layers": 1, "reformat_bytes": 2 * 3 * 16 * 24 * 2}


RTX_CC = ("8.0", "8.6", "8.9", "12.0")


@pytest.mark.gpu
@pytest.mark.skipif(not any(gpu_for(cc) for cc in RTX_CC), reason=no_gpu_reason("8.0/8.6/8.9/12.x (a TensorRT-RTX target)"))
def test_engine_layer_list_on_the_gpu(tmp_path, backend):
    """Where a GPU of the target is present the build reads the engine's own reformat layers beside the estimate."""
    from tasks.engines.build import engine_from_onnx, precision_boundaries

    cc = next(cc for cc in RTX_CC if gpu_for(cc))
    onnx_path = chain(tmp_path / "mixed.onnx", {"conv1", "conv3"})
    eng = engine_from_onnx(onnx_path, tmp_path / "mixed.engine", PROFILE, cc, {"optimization_level": 3, "workspace_mib": None}, backend,
                           show_progress=False).files["engine"]
    prof = precision_profile_from_onnx([onnx_path], [PROFILE], backend)
    m = precision_boundaries(prof["metrics"], [eng], cc, backend)
    assert m["reformat_source"].startswith("the engine's layer list")
    assert m["reformat_layers"] == m["engine_reformat_layers"] >= 1
    assert m["network_reformat_layers"] == 4
