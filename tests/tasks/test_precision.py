"""fp16_from_onnx on the PP-OCRv4 models shipped with rapidocr_onnxruntime and on
tiny hand-built graphs reproducing onnxconverter-common traps."""

import importlib.util
import os
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

from tasks.precision import fp16_from_onnx

ort = pytest.importorskip("onnxruntime")

FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"
MIN_COSINE = 0.999


def _models_dir():
    # Locate without importing rapidocr_onnxruntime (that pulls cv2).
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None:
        return None
    return spec.submodule_search_locations[0] + "/models/"


# name -> (file, TensorRT profile (min, opt, max) for input "x")
MODELS = {
    "det": (
        "ch_PP-OCRv4_det_infer.onnx",
        ((1, 3, 32, 32), (1, 3, 640, 640), (4, 3, 1280, 1280)),
    ),
    "rec": (
        "ch_PP-OCRv4_rec_infer.onnx",
        ((1, 3, 48, 32), (8, 3, 48, 320), (32, 3, 48, 1024)),
    ),
    "cls": (
        "ch_ppocr_mobile_v2.0_cls_infer.onnx",
        ((1, 3, 48, 192), (8, 3, 48, 192), (32, 3, 48, 192)),
    ),
}


# ---------------------------------------------------------------- helpers


def _page(h, w, size, lines):
    """White page with black text, as BGR float32 in [0, 255]."""
    from PIL import Image, ImageDraw, ImageFont

    im = Image.new("RGB", (w, h), "white")
    draw = ImageDraw.Draw(im)
    font = ImageFont.truetype(FONT, size)
    for i, text in enumerate(lines):
        draw.text((8, 6 + i * (size + 10)), text, fill="black", font=font)
    return np.asarray(im)[:, :, ::-1].astype(np.float32)


def _det_input(h, w):
    lines = ["Hello world 123", "TensorRT fp16 test", "PP-OCRv4 detection", "the quick brown fox", "jumps over 42 dogs"]
    x = _page(h, w, 22, lines[: max(1, h // 64)]) / 255.0
    x = (x - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
    return x.transpose(2, 0, 1)[None].astype(np.float32)


def _line_input(w, text):
    x = (_page(48, w, 30, [text]) / 255.0 - 0.5) / 0.5
    return x.transpose(2, 0, 1)[None].astype(np.float32)


INPUTS = {
    "det": lambda: [_det_input(320, 320), _det_input(256, 416)],
    "rec": lambda: [_line_input(320, "Hello 2024 world")],
    "cls": lambda: [_line_input(192, "Hello")],
}


def _run(model, x):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def _cosine(a, b):
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _trt_engine_bytes(model, profile):
    trt = pytest.importorskip("tensorrt_rtx_bindings")
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    net = builder.create_network(0)  # strongly typed by default
    parser = trt.OnnxParser(net, logger)
    ok = parser.parse(model.SerializeToString())
    assert ok, [str(parser.get_error(i)) for i in range(parser.num_errors)]
    cfg = builder.create_builder_config()
    cfg.num_compute_capabilities = 1
    cfg.set_compute_capability(trt.ComputeCapability.SM86, 0)
    prof = builder.create_optimization_profile()
    prof.set_shape("x", *profile)
    cfg.add_optimization_profile(prof)
    engine = builder.build_serialized_network(net, cfg)
    assert engine is not None, "TensorRT-RTX build failed"
    return engine.nbytes


def _convert(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # converter warns about clamped values
        return fp16_from_onnx(model)


def _check_structure(fp32, fp16):
    onnx.checker.check_model(fp16, full_check=True)
    onnx.shape_inference.infer_shapes(fp16, check_type=True, strict_mode=True)
    names = [n.name for n in fp16.graph.node]
    assert all(names) and len(names) == len(set(names))
    # drop-in: same I/O names and fp32 I/O types
    for a, b in ((fp32.graph.input, fp16.graph.input), (fp32.graph.output, fp16.graph.output)):
        assert [v.name for v in a] == [v.name for v in b]
        assert all(v.type.tensor_type.elem_type == TP.FLOAT for v in b)
    assert any(t.data_type == TP.FLOAT16 for t in fp16.graph.initializer)


# ---------------------------------------------------------------- real models


@pytest.fixture(scope="module")
def converted():
    """name -> (fp32 model, fp16 model, stats); each model converted once."""
    d = _models_dir()
    if d is None or not os.path.isdir(d):
        pytest.skip("rapidocr_onnxruntime models not installed")
    cache = {}
    for name, (fname, _) in MODELS.items():
        fp32 = onnx.load(d + fname)
        if name == "cls":
            # H and W share the symbolic name "?"; give each dim its own name.
            dims = fp32.graph.input[0].type.tensor_type.shape.dim
            for dim, label in zip(dims, ("N", None, "H", "W")):
                if label:
                    dim.dim_param = label
        fp16, stats = _convert(fp32)
        print(name, stats)
        cache[name] = (fp32, fp16, stats)
    return cache


@pytest.mark.parametrize("name", list(MODELS))
def test_real_model_structure(converted, name):
    fp32, fp16, stats = converted[name]
    _check_structure(fp32, fp16)
    assert stats["fp16_nodes"] > stats["fp32_nodes"]


@pytest.mark.parametrize("name", list(MODELS))
def test_real_model_accuracy(converted, name):
    fp32, fp16, _ = converted[name]
    for x in INPUTS[name]():
        ref, out = _run(fp32, x), _run(fp16, x)
        assert len(ref) == len(out)
        for a, b in zip(ref, out):
            assert a.shape == b.shape and b.dtype == np.float32
            # text pages give det a non-trivial probability map
            assert np.abs(a).max() > 0.5
            cos = _cosine(a, b)
            print(name, x.shape, "cosine", cos)
            assert cos >= MIN_COSINE


@pytest.mark.parametrize("name", list(MODELS))
def test_real_model_tensorrt_build(converted, name):
    _, fp16, _ = converted[name]
    nbytes = _trt_engine_bytes(fp16, MODELS[name][1])
    print(name, "engine bytes", nbytes)
    assert nbytes > 0


def test_det_batchnorm_kept_fp32(converted):
    # PP-OCRv4 det stores BN variances up to ~1e8 in Constant nodes.
    _, fp16, stats = converted["det"]
    assert stats["constants_folded"] > 0
    assert stats["kept_fp32_ops"].get("BatchNormalization") == 3
    inits = {t.name: t for t in fp16.graph.initializer}
    bn_params = [i for n in fp16.graph.node if n.op_type == "BatchNormalization" for i in n.input[1:]]
    assert all(inits[i].data_type == TP.FLOAT for i in bn_params)
    assert max(np.abs(nh.to_array(inits[i])).max() for i in bn_params) > 1e7


# ---------------------------------------------------------------- tiny graphs


def _const(name, value, dtype=np.float32):
    return oh.make_node("Constant", [], [name], value=nh.from_array(np.asarray(value, dtype), name))


def _tiny_model():
    """Conv + shape-only anchor grid (int and float Range) + Cast(to=FLOAT) on
    the data path.  Nodes are unnamed on purpose: the converter derives Cast
    names from node names and would produce duplicates."""
    rng = np.random.default_rng(0)
    nodes = [
        _const("w", rng.normal(size=(4, 3, 3, 3)) * 0.3),
        _const("b", rng.normal(size=4) * 0.1),
        oh.make_node("Conv", ["x", "w", "b"], ["conv"], pads=[1, 1, 1, 1]),
        # grid = (arange_int(W) + arange_float(W)) * stride / W
        oh.make_node("Shape", ["x"], ["shp"]),
        _const("i3", 3, np.int64),
        oh.make_node("Gather", ["shp", "i3"], ["wid"]),
        _const("zero", 0, np.int64),
        _const("one", 1, np.int64),
        oh.make_node("Range", ["zero", "wid", "one"], ["ar"]),
        oh.make_node("Cast", ["ar"], ["ar_f"], to=TP.FLOAT),
        oh.make_node("Cast", ["wid"], ["wid_f"], to=TP.FLOAT),
        _const("zero_f", 0.0),
        _const("one_f", 1.0),
        oh.make_node("Range", ["zero_f", "wid_f", "one_f"], ["ar2_f"]),
        oh.make_node("Add", ["ar_f", "ar2_f"], ["ar_sum"]),
        _const("stride", 0.5),  # shared by a shape-only and a data node
        oh.make_node("Mul", ["ar_sum", "stride"], ["grid"]),
        oh.make_node("Div", ["grid", "wid_f"], ["grid_n"]),
        oh.make_node("Add", ["conv", "grid_n"], ["y1"]),
        oh.make_node("Cast", ["y1"], ["y1_c"], to=TP.FLOAT),
        oh.make_node("Mul", ["y1_c", "stride"], ["y2"]),
        oh.make_node("Relu", ["y2"], ["y"]),
    ]
    graph = oh.make_graph(
        nodes,
        "tiny",
        [oh.make_tensor_value_info("x", TP.FLOAT, ["N", 3, "H", "W"])],
        [oh.make_tensor_value_info("y", TP.FLOAT, ["N", 4, "H", "W"])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def tiny():
    fp32 = _tiny_model()
    before = fp32.SerializeToString()
    fp16, stats = _convert(fp32)
    assert fp32.SerializeToString() == before, "input model was modified"
    return fp32, fp16, stats


def test_tiny_structure_and_stats(tiny):
    fp32, fp16, stats = tiny
    _check_structure(fp32, fp16)
    assert stats["casts_retargeted"] >= 1  # Cast(to=FLOAT) on the data path
    # Shape, Gather, 2x Range, 2x Cast, Add, Mul, Div stay fp32;
    # Conv, Add, Cast, Mul, Relu go fp16
    assert (stats["fp32_nodes"], stats["fp16_nodes"]) == (9, 5)
    # shape-only nodes stay fp32: no fp16 Cast directly on shape values
    producers = {o: n for n in fp16.graph.node for o in n.output}
    for n in fp16.graph.node:
        if n.op_type == "Range":
            assert all(producers[i].op_type != "Cast" or producers[i].attribute[0].i != TP.FLOAT16 for i in n.input if i in producers)


def test_tiny_accuracy(tiny):
    fp32, fp16, _ = tiny
    rng = np.random.default_rng(1)
    for shape in [(1, 3, 16, 24), (2, 3, 40, 8)]:
        x = rng.normal(size=shape).astype(np.float32)
        assert _cosine(_run(fp32, x)[0], _run(fp16, x)[0]) >= MIN_COSINE


def test_tiny_tensorrt_build(tiny):
    _, fp16, _ = tiny
    assert _trt_engine_bytes(fp16, ((1, 3, 8, 8), (1, 3, 32, 32), (2, 3, 64, 64))) > 0


def test_overflowing_initializer_keeps_consumer_fp32():
    nodes = [
        _const("big", [1e5]),  # > fp16 max
        oh.make_node("Mul", ["x", "big"], ["scaled"], name="mul"),
        oh.make_node("Relu", ["scaled"], ["y"], name="relu"),
    ]
    graph = oh.make_graph(
        nodes,
        "overflow",
        [oh.make_tensor_value_info("x", TP.FLOAT, ["N", 8])],
        [oh.make_tensor_value_info("y", TP.FLOAT, ["N", 8])],
    )
    fp32 = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    fp16, stats = _convert(fp32)
    onnx.checker.check_model(fp16, full_check=True)
    assert stats["fp32_reasons"] == {"initializer_range": 1}
    big = next(t for t in fp16.graph.initializer if t.name == "big")
    assert big.data_type == TP.FLOAT and nh.to_array(big)[0] == 1e5
    x = (np.random.default_rng(2).normal(size=(4, 8)) * 1e-2).astype(np.float32)
    assert _cosine(_run(fp32, x)[0], _run(fp16, x)[0]) >= MIN_COSINE


def test_graph_output_from_fp32_node_stays_fp32():
    # The converter leaves an output produced by a blocked node (BN here) fp16.
    nodes = [
        _const("w", np.full((2, 3, 1, 1), 0.1)),
        oh.make_node("Conv", ["x", "w"], ["conv"]),
        _const("scale", np.ones(2)),
        _const("bias", np.zeros(2)),
        _const("mean", np.zeros(2)),
        _const("var", np.full(2, 1e6)),
        oh.make_node("BatchNormalization", ["conv", "scale", "bias", "mean", "var"], ["y"]),
        oh.make_node("Relu", ["conv"], ["z"]),
    ]
    graph = oh.make_graph(
        nodes,
        "bn_output",
        [oh.make_tensor_value_info("x", TP.FLOAT, ["N", 3, "H", "W"])],
        [oh.make_tensor_value_info("y", TP.FLOAT, None), oh.make_tensor_value_info("z", TP.FLOAT, None)],
    )
    fp32 = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    fp16, _ = _convert(fp32)
    _check_structure(fp32, fp16)
    x = np.random.default_rng(3).random((1, 3, 4, 4)).astype(np.float32)
    for a, b in zip(_run(fp32, x), _run(fp16, x)):
        assert b.dtype == np.float32 and _cosine(a, b) >= MIN_COSINE
