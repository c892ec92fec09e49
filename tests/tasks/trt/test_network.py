"""The precision profile on tiny graphs built in code, parsed by the real TensorRT-RTX parser: FLOPs per layer against
hand-computed counts, precisions from the network's tensor types (fp32, fp16 graph, int8 and fp8 Q/DQ graphs)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tasks.trt.backend import Backend
from tasks.engines.build import onnx_at_precision
from tasks.quantization.calibrate import qdq_from_onnx
from tasks.trt.network import describe, precision_profile, precision_profile_from_onnx, summarize
from tests.conftest import make_conv_model

N, H, W = 2, 16, 24
PROFILE = [{"x": {"min": [1, 3, 8, 8], "opt": [N, 3, H, W], "max": [4, 3, 32, 32]}}]
CONV1 = 2 * N * 8 * H * W * 3 * 9  # 2 * out elements * Cin * kh * kw
CONV2 = 2 * N * 4 * H * W * 8 * 9
RELU = N * 8 * H * W


@pytest.fixture(scope="module")
def backend():
    return Backend("tensorrt_rtx")


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    d = tmp_path_factory.mktemp("flops")
    fp32 = make_conv_model(d / "tiny.onnx", opset=13)
    fp16 = onnx_at_precision(fp32, "fp16", d / "tiny_fp16.onnx").files["onnx"]
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(2)]
    int8 = qdq_from_onnx(fp32, feeds, d / "tiny_int8.onnx", method="minmax").files["onnx"]
    fp8 = qdq_from_onnx(fp32, feeds, d / "tiny_fp8.onnx", method="minmax", precision="fp8").files["onnx"]
    return {"fp32": fp32, "fp16": fp16, "int8": int8, "fp8": fp8, "dir": d}


def _profile(path, backend):
    return precision_profile_from_onnx([path], [PROFILE], backend)


def _by_type(rows, kind):
    return [r for r in rows if r["type"] == kind]


def test_fp32_counts_and_shares(graphs, backend):
    p = _profile(graphs["fp32"], backend)
    convs = _by_type(p["layers"], "CONVOLUTION")
    assert [c["flops"] for c in convs] == [CONV1, CONV2]
    assert [r["flops"] for r in _by_type(p["layers"], "ACTIVATION")] == [RELU]
    m = p["metrics"]
    assert m["flops_share"] == {"fp32": 1.0, "fp16": 0.0, "int8": 0.0, "fp8": 0.0}
    assert m["gflops"] * 1e9 == pytest.approx(CONV1 + CONV2 + RELU)
    assert m["precision_layers"]["fp32"] == 3 and m["conv_int8_share"] == 0.0
    assert p["unresolved_dims"] == 0


def test_fp16_graph_runs_in_fp16(graphs, backend):
    m = _profile(graphs["fp16"], backend)["metrics"]
    assert m["flops_share"]["fp16"] == 1.0, m  # the graph-I/O casts count no FLOPs
    assert m["precision_layers"]["fp16"] == 3 and m["precision_layers"]["fp32"] == 0


@pytest.mark.parametrize("q", ["int8", "fp8"])
def test_qdq_convs_counted_at_their_quantized_type(graphs, backend, q):
    """Both convs are fed by DQ of int8 (fp8) tensors; the Relu between them runs in the fp16 remainder."""
    p = _profile(graphs[q], backend)
    assert {r["precision"] for r in _by_type(p["layers"], "CONVOLUTION")} == {q}
    assert {r["precision"] for r in _by_type(p["layers"], "ACTIVATION")} == {"fp16"}
    m = p["metrics"]
    assert m["flops_share"][q] == pytest.approx((CONV1 + CONV2) / (CONV1 + CONV2 + RELU))
    assert m["flops_share"]["fp16"] == pytest.approx(RELU / (CONV1 + CONV2 + RELU))
    assert m["flops_share"]["fp32"] == 0.0 and sum(m["flops_share"].values()) == pytest.approx(1.0)
    assert m[f"conv_{q}_share"] == 1.0 and m["precision_layers"][q] == 2
    assert m["precision_layers"]["other"] > 0  # the Q/DQ and constant layers: no FLOPs, no precision of their own


def test_matmul_and_deconvolution_flops(tmp_path, backend):
    rng = np.random.default_rng(1)
    wt = numpy_helper.from_array(rng.standard_normal((4, 6, 2, 2)).astype(np.float32), "wt")  # Cin 4 -> Cout 6
    wm = numpy_helper.from_array(rng.standard_normal((10, 5)).astype(np.float32), "wm")
    g = helper.make_graph(
        [helper.make_node("ConvTranspose", ["x", "wt"], ["y"], strides=[2, 2], name="deconv"),
         helper.make_node("MatMul", ["a", "wm"], ["z"], name="mm")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 5, 7]),
         helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n", 3, 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], initializer=[wt, wm])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "mm.onnx"))
    prof = [{"a": {"min": [1, 3, 10], "opt": [8, 3, 10], "max": [16, 3, 10]}}]
    rows = precision_profile_from_onnx([tmp_path / "mm.onnx"], [prof], backend)["layers"]
    assert [r["flops"] for r in _by_type(rows, "DECONVOLUTION")] == [2 * (4 * 5 * 7) * 6 * 4]  # 2 * in * Cout * k
    assert [r["flops"] for r in _by_type(rows, "MATRIX_MULTIPLY")] == [2 * (8 * 3 * 5) * 10]  # 2 * out * K (opt N=8)


def test_batched_matmul_on_a_quantized_2d_weight_counts_as_int8(tmp_path, backend):
    """[n, 3, 10] x [10, 5]: the parser reshapes the DQ'd weight (a SHUFFLE between DQ and the matrix multiply);
    both operands are still int8 Q/DQ, as in every quantized transformer's Linear layers."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.integers(-127, 128, (10, 5)).astype(np.int8), "wq"),
             numpy_helper.from_array(np.array(0.01, np.float32), "ws"), numpy_helper.from_array(np.array(0, np.int8), "z"),
             numpy_helper.from_array(np.array(0.05, np.float32), "s")]
    g = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["a", "s", "z"], ["aq"]), helper.make_node("DequantizeLinear", ["aq", "s", "z"], ["ad"]),
         helper.make_node("DequantizeLinear", ["wq", "ws", "z"], ["w"]), helper.make_node("MatMul", ["ad", "w"], ["y"], name="mm")],
        "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n", 3, 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "qmm.onnx"))
    prof = [{"a": {"min": [1, 3, 10], "opt": [8, 3, 10], "max": [16, 3, 10]}}]
    p = precision_profile_from_onnx([tmp_path / "qmm.onnx"], [prof], backend)
    assert "SHUFFLE" in {r["type"] for r in p["layers"]}  # what hid the DQ before
    assert [r["precision"] for r in _by_type(p["layers"], "MATRIX_MULTIPLY")] == ["int8"]
    assert p["metrics"]["flops_share"]["int8"] == 1.0, p["metrics"]


def test_summary_of_no_float_flops_and_files(graphs, backend):
    s = summarize([{"type": "SHUFFLE", "precision": "fp32", "flops": 0.0}])
    assert "flops_share" not in s and "conv_int8_share" not in s  # no FLOPs at all: no share is made up
    assert s["precision_layers"]["other"] == 1 and "no FLOPs estimated" in describe(s)
    r = precision_profile([graphs["int8"]], [PROFILE], backend, graphs["dir"] / "prof", "tiny int8")
    assert r.files["precision_profile"].is_file() and r.files["precision_profile_plot"].stat().st_size > 5000
    assert "int8" in describe(r.metrics) and r.metrics["flops_share"]["int8"] > 0.9


def test_a_quantized_1d_conv_kept_fp32_by_range_reads_its_dq_directly_and_counts_as_int8(tmp_path, backend):
    """A mel front end's filter bank at int8 on 16-bit audio: its output leaves fp16's range, so the range check keeps
    it fp32. Its DQs output fp32 into it (DequantizeLinear nodes converted to fp16 with a Cast before the Conv are not
    fused by TensorRT: the 'quantized' Conv would run in fp32, flops_share int8 0.0), and the parser's Unsqueeze
    (1-D Conv as 2-D) is looked through as TensorRT does: the Conv counts as int8. Real TensorRT-RTX."""
    from tasks.engines.build import engine_from_onnx
    from tests.conftest import audio_16bit, make_audio_power_model

    path = make_audio_power_model(tmp_path / "mel.onnx")
    x = audio_16bit(8, seed=1)
    feeds = [{"x": x[i:i + 2]} for i in range(0, 8, 2)]
    r = qdq_from_onnx(path, feeds, tmp_path / "mel_int8.onnx", method="minmax")
    assert "filterbank" in r.details["quantized"] and r.details["fp32_by_data_range"]
    g = onnx.load(str(r.files["onnx"])).graph
    producer = {o: n for n in g.node for o in n.output}
    conv = next(n for n in g.node if n.name == "filterbank")
    feeding = [producer[i] for i in conv.input[:2]]
    assert [n.op_type for n in feeding] == ["DequantizeLinear", "DequantizeLinear"], [n.op_type for n in feeding]
    profile = [{"x": {"min": [1, 1, 256], "opt": [2, 1, 256], "max": [4, 1, 256]}}]
    engine_from_onnx(r.files["onnx"], tmp_path / "mel_int8.engine", profile, "8.6",
                     {"optimization_level": 3, "workspace_mib": None}, backend, show_progress=False)
    p = precision_profile_from_onnx([r.files["onnx"]], [profile], backend)
    by_name = {row["name"]: row for row in p["layers"]}
    assert by_name["filterbank"]["precision"] == "int8", by_name["filterbank"]
    assert p["metrics"]["flops_share"]["int8"] > 0


def test_a_label_must_name_what_the_engine_computes():
    from tasks.trt.network import label_disagreement

    share = lambda **k: {p: k.get(p, 0.0) for p in ("fp32", "fp16", "int8", "fp8")}  # noqa: E731
    assert label_disagreement("fp32", share(fp32=1.0)) is None
    assert label_disagreement("fp32", share(fp32=0.4, fp16=0.6)) == "fp32 40.0%, fp16 60.0% of its FLOPs"
    assert label_disagreement("fp32", share(fp32=0.3, int8=0.7))  # a quantized model's int8 layers are not fp32
    assert label_disagreement("fp16", share(fp16=0.9, fp32=0.1)) is None
    assert label_disagreement("fp16", share(fp16=0.1, int8=0.9)) is None  # int8 model, its float part in fp16
    assert label_disagreement("fp16", share(fp32=1.0))  # every layer kept fp32: not an fp16 engine
    assert label_disagreement("int8", share(fp16=0.2, int8=0.8)) is None
    assert label_disagreement("int8", share(fp32=1.0))
    assert label_disagreement("fp8", share(fp16=0.5, int8=0.5))
    assert label_disagreement("fp16", None) is None  # no FLOPs estimated: nothing to disagree with


def test_a_graph_the_profile_cannot_parse_says_why_once_and_prints_nothing_itself(tmp_path):
    """TensorRT's own Logger printed every parser message (and "cudaError 35" on a host without a driver) straight
    to the terminal, ahead of the build's output: the reason goes into the error, once, and nothing else is printed."""
    import subprocess
    import sys

    code = ("import sys\nfrom pathlib import Path\nfrom tasks.trt import Backend\nfrom tasks.trt import network as flops\n"
            "from tests.conftest import make_conv_model\n"
            f"p = make_conv_model(Path({str(tmp_path / 'custom.onnx')!r}), custom_op='Foo')\n"
            "try:\n"
            "    flops._network(p, {'x': {'min': [1, 3, 8, 8], 'opt': [2, 3, 16, 16], 'max': [4, 3, 32, 32]}},"
            " Backend('tensorrt_rtx'))\n"
            "except Exception as e:\n"
            "    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=str(__import__("pathlib").Path(__file__).resolve().parents[3]))
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # nothing of TensorRT's own on the terminal
    first = r.stdout.splitlines()[0]
    assert "could not parse the graph at the opt shape" in first and "Plugin not found" in first
    assert first.count("Plugin not found") == 1
