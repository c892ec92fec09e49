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

from tasks.trt.backend import Backend
from tasks.fp16.convert import fp16_from_onnx

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


from tasks.accuracy.metrics import cosine as _cosine  # noqa: E402


def _trt_engine_bytes(model, profile):
    trt = pytest.importorskip("tensorrt_rtx_bindings")
    builder, net, parser = Backend("tensorrt_rtx").parser()  # the backend's logger (strongly typed by default)
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


@pytest.mark.parametrize("form", ["log", "layernorm"])
def test_a_tiny_guard_and_what_it_guards_stay_fp32(form):
    """log(x^2 + 1e-10) (Basic Pitch's spectrogram) and x / sqrt(v + 1e-12) (a decomposed normalization): the eps is
    beyond fp16, so its Add stays fp32, and the Log or the Sqrt and the Div it guards stay fp32 too: cast back to fp16,
    the guarded value of quiet input is 0 again (-inf, inf)."""
    if form == "log":
        nodes = [_const("eps", [1e-10]), oh.make_node("Mul", ["x", "x"], ["sq"], name="square"),
                 oh.make_node("Add", ["sq", "eps"], ["guarded"], name="add_eps"),
                 oh.make_node("Log", ["guarded"], ["y"], name="log")]
        guarded = {"log"}
    else:
        nodes = [_const("eps", [1e-12]), oh.make_node("Mul", ["x", "x"], ["sq"], name="square"),
                 oh.make_node("ReduceMean", ["sq"], ["var"], name="var", keepdims=1, axes=[1]),
                 oh.make_node("Add", ["var", "eps"], ["guarded"], name="add_eps"),
                 oh.make_node("Sqrt", ["guarded"], ["std"], name="sqrt"),
                 oh.make_node("Div", ["x", "std"], ["y"], name="div")]
        guarded = {"sqrt", "div"}
    graph = oh.make_graph(nodes, form, [oh.make_tensor_value_info("x", TP.FLOAT, ["N", 8])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, ["N", 8])])
    fp32 = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    fp16, stats = _convert(fp32)
    onnx.checker.check_model(fp16, full_check=True)
    assert stats["fp32_reasons"] == {"initializer_range": 1, "tiny_guard": len(guarded)}, stats["fp32_reasons"]
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 8)).astype(np.float32)
    x[0] *= 1e-5  # quiet: its square, 1e-10, is below fp16's smallest subnormal
    got, ref = _run(fp16, x)[0], _run(fp32, x)[0]
    assert np.isfinite(got).all() and _cosine(got, ref) >= MIN_COSINE


def test_a_weight_shared_through_identities_stays_one_fp16_weight():
    """torch.onnx shares a reused module's weight through Identity nodes: converted, the layers read one fp16 weight
    (not the fp32 weight cast per layer, which TensorRT folds into a copy per layer), and the fp16 engine is about half
    the fp32 one."""
    rng = np.random.default_rng(4)
    d, layers = 512, 4
    w = nh.from_array((rng.standard_normal((d, d)) * 0.04).astype(np.float32), "w")
    nodes, x = [], "x"
    for i in range(layers):
        nodes += [oh.make_node("Identity", ["w"], [f"w{i}"], name=f"share{i}"),
                  oh.make_node("MatMul", [x, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  oh.make_node("Relu", [f"m{i}"], [f"r{i}"], name=f"relu{i}")]
        x = f"r{i}"
    graph = oh.make_graph(nodes, "shared", [oh.make_tensor_value_info("x", TP.FLOAT, ["N", d])],
                          [oh.make_tensor_value_info(x, TP.FLOAT, ["N", d])], [w])
    fp32 = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    fp16, _ = _convert(fp32)
    onnx.checker.check_model(fp16, full_check=True)
    weights = [t for t in fp16.graph.initializer if len(t.dims) == 2]
    assert [t.data_type for t in weights] == [TP.FLOAT16], [(t.name, t.data_type) for t in weights]
    assert not [n for n in fp16.graph.node if n.op_type in ("Identity", "Cast") and n.input[0] == "w"]
    x = rng.standard_normal((2, d)).astype(np.float32)
    assert _cosine(_run(fp32, x)[0], _run(fp16, x)[0]) >= MIN_COSINE
    profile = ((1, d), (2, d), (4, d))
    assert _trt_engine_bytes(fp16, profile) < 0.7 * _trt_engine_bytes(fp32, profile)


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


# ------------------------------------------------ failure modes of real models


def _ort_io(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


def _trt_build(model, profiles=None):
    """TensorRT-RTX parse (errors asserted) and, given {input: (min, opt, max)}, build."""
    trt = pytest.importorskip("tensorrt_rtx_bindings")
    builder, net, parser = Backend("tensorrt_rtx").parser()  # the backend's logger
    ok = parser.parse(model.SerializeToString())
    assert ok, [str(parser.get_error(i)) for i in range(parser.num_errors)]
    if profiles is None:
        return None
    cfg = builder.create_builder_config()
    cfg.num_compute_capabilities = 1
    cfg.set_compute_capability(trt.ComputeCapability.SM86, 0)
    prof = builder.create_optimization_profile()
    for name, shapes in profiles.items():
        prof.set_shape(name, *shapes)
    cfg.add_optimization_profile(prof)
    engine = builder.build_serialized_network(net, cfg)
    assert engine is not None, "TensorRT-RTX build failed"
    return engine.nbytes


def _yolo_head_model(with_max=False):
    """YOLOv8-style head (NudeNet 320n): output0 = Concat(boxes + shape-only
    anchor grid, Sigmoid(scores)); optionally output1 from Max (a blocked op).
    As in the exported model, the graph outputs are listed in value_info too:
    the converter flipped that copy to fp16, and the fp32 output Cast then became
    an fp16 one (ORT: "Type (tensor(float)) of output arg (output0) of node
    (concat_cast_to_output0) does not match expected type"); with the Max output
    onnxconverter-common's cast cleanup raised "The downstream node of the second
    cast node should be graph output"."""
    rng = np.random.default_rng(4)
    w = nh.from_array((rng.normal(size=(6, 3, 1, 1)) * 0.3).astype(np.float32), "w")
    inits = [
        w,
        nh.from_array(np.array([0, 2, 4], np.int64), "split"),
        nh.from_array(np.array(3, np.int64), "i3"),
        nh.from_array(np.array(0, np.int64), "zero"),
        nh.from_array(np.array(1, np.int64), "one"),
        nh.from_array(np.array([1, 1, -1], np.int64), "grid_shape"),
        nh.from_array(np.array(8.0, np.float32), "stride"),
        nh.from_array(np.array([1, 2, -1], np.int64), "flat2"),
        nh.from_array(np.array([1, 4, -1], np.int64), "flat4"),
        nh.from_array(np.array(0.0, np.float32), "fzero"),
    ]
    nodes = [
        oh.make_node("Conv", ["images", "w"], ["feat"], name="conv"),
        oh.make_node("Slice", ["feat", "zero_1d", "two_1d", "one_1d"], ["box"], name="slice_box"),
        oh.make_node("Slice", ["feat", "two_1d", "six_1d", "one_1d"], ["cls"], name="slice_cls"),
        # anchor grid from the input width: Shape -> Gather -> Range -> Cast -> Mul(stride)
        oh.make_node("Shape", ["feat"], ["shp"], name="shape"),
        oh.make_node("Gather", ["shp", "i3"], ["wid"], name="gather_w"),
        oh.make_node("Range", ["zero", "wid", "one"], ["ar"], name="range"),
        oh.make_node("Cast", ["ar"], ["ar_f"], to=TP.FLOAT, name="cast_ar"),
        oh.make_node("Mul", ["ar_f", "stride"], ["grid"], name="grid_mul"),
        oh.make_node("Reshape", ["grid", "grid_shape"], ["grid4"], name="grid_reshape"),
        oh.make_node("Add", ["box", "grid4"], ["box_g"], name="box_add"),
        oh.make_node("Reshape", ["box_g", "flat2"], ["box_f"], name="box_flat"),
        oh.make_node("Sigmoid", ["cls"], ["cls_s"], name="sigmoid"),
        oh.make_node("Reshape", ["cls_s", "flat4"], ["cls_f"], name="cls_flat"),
        oh.make_node("Concat", ["box_f", "cls_f"], ["output0"], axis=1, name="concat"),
    ]
    for name, v in (("zero_1d", 0), ("one_1d", 1), ("two_1d", 2), ("six_1d", 6)):
        inits.append(nh.from_array(np.array([v], np.int64), name))
    out0 = oh.make_tensor_value_info("output0", TP.FLOAT, [1, 6, "A"])
    outputs = [out0]
    if with_max:
        nodes.append(oh.make_node("Max", ["cls_f", "fzero"], ["output1"], name="max"))
        outputs.append(oh.make_tensor_value_info("output1", TP.FLOAT, [1, 4, "A"]))
    graph = oh.make_graph(
        nodes, "yolo_head", [oh.make_tensor_value_info("images", TP.FLOAT, [1, 3, "H", "W"])], outputs, inits,
        value_info=outputs,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("with_max", [False, True])
def test_graph_output_listed_in_value_info_stays_fp32(with_max):
    fp32 = _yolo_head_model(with_max)
    onnx.checker.check_model(fp32, full_check=True)
    fp16, stats = _convert(fp32)
    _check_structure(fp32, fp16)
    assert stats["fp32_reasons"].get("shape_only", 0) >= 4
    assert stats["kept_fp32_ops"].get("Max", 0) == with_max
    producers = {o: n for n in fp16.graph.node for o in n.output}
    for name in [o.name for o in fp32.graph.output]:
        assert producers[name].op_type == "Cast" and producers[name].attribute[0].i == TP.FLOAT
    x = np.random.default_rng(5).random((1, 3, 8, 12)).astype(np.float32)
    for a, b in zip(_run_images(fp32, x), _run_images(fp16, x)):
        assert b.dtype == np.float32 and _cosine(a, b) >= MIN_COSINE


def _run_images(model, x):
    return _ort_io(model, {"images": x})


def test_graph_output_listed_in_value_info_tensorrt_build():
    # dynamic H/W: the shape-only anchor grid must stay fp32 for the builder
    fp16, _ = _convert(_yolo_head_model(with_max=True))
    assert _trt_build(fp16, {"images": ((1, 3, 8, 8), (1, 3, 16, 16), (1, 3, 32, 48))}) > 0


def _if_model():
    """Silero-VAD-style If: the branches read the fp32 graph input ``state`` (also
    used by a top-level Shape, kept fp32), a top-level fp16 tensor, an outer
    initializer, and a nested If reads ``state`` two scopes up; a Max (blocked,
    fp32) inside a branch reads a top-level tensor.  The branches must not point
    at a per-consumer input Cast that is removed afterwards
    (TensorRT: "Node input was not registered"; ORT: not topologically sorted)."""
    rng = np.random.default_rng(6)
    inits = [
        nh.from_array((rng.normal(size=(4, 4)) * 0.5).astype(np.float32), "w"),
        nh.from_array(np.array(0, np.int64), "i0"),
        nh.from_array(np.array(1, np.int64), "i1"),
        nh.from_array(np.array(2, np.int64), "two"),
        nh.from_array(np.array(0.5, np.float32), "half"),
    ]
    nested = oh.make_node(
        "If", ["inner_cond"], ["nested_out"], name="nested_if",
        then_branch=oh.make_graph(
            [oh.make_node("Gather", ["state", "i1"], ["s1"], axis=0, name="then_gather1"),
             oh.make_node("Mul", ["s1", "half"], ["nested_then"], name="then_mul_half")],
            "nested_then", [], [oh.make_tensor_value_info("nested_then", TP.FLOAT, None)]),
        else_branch=oh.make_graph(
            [oh.make_node("Neg", ["hx"], ["nested_else"], name="else_neg")],
            "nested_else", [], [oh.make_tensor_value_info("nested_else", TP.FLOAT, None)]),
    )
    then_branch = oh.make_graph(
        [
            oh.make_node("Gather", ["state", "i0"], ["s0"], axis=0, name="then_gather0"),
            oh.make_node("MatMul", ["s0", "w"], ["s0w"], name="then_matmul"),
            oh.make_node("Add", ["s0w", "hx"], ["s0wx"], name="then_add"),
            oh.make_node("Greater", ["i1", "i0"], ["inner_cond"], name="then_greater"),
            nested,
            oh.make_node("Add", ["s0wx", "nested_out"], ["t_sum"], name="then_add2"),
            oh.make_node("Max", ["t_sum", "hx"], ["then_out"], name="then_max"),
        ],
        "then", [], [oh.make_tensor_value_info("then_out", TP.FLOAT, None)],
    )
    else_branch = oh.make_graph(
        [oh.make_node("Gather", ["state", "i1"], ["g1"], axis=0, name="else_gather"),
         oh.make_node("Sub", ["g1", "hx"], ["else_out"], name="else_sub")],
        "else", [], [oh.make_tensor_value_info("else_out", TP.FLOAT, None)],
    )
    nodes = [
        # `state`'s last top-level consumer is the fp32 Shape (as in Silero VAD):
        # the converter pointed the branches at its input Cast, removed later.
        oh.make_node("Mul", ["state", "half"], ["stateN"], name="state_mul"),
        oh.make_node("MatMul", ["x", "w"], ["xw"], name="matmul"),
        oh.make_node("Tanh", ["xw"], ["hx"], name="tanh"),
        oh.make_node("Shape", ["state"], ["sshape"], name="state_shape"),
        oh.make_node("Gather", ["sshape", "i0"], ["sdim"], name="state_dim"),
        oh.make_node("Equal", ["sdim", "two"], ["cond"], name="equal"),
        oh.make_node("If", ["cond"], ["branch_out"], then_branch=then_branch, else_branch=else_branch, name="if"),
        oh.make_node("Relu", ["branch_out"], ["y"], name="relu"),
    ]
    graph = oh.make_graph(
        nodes, "if_outer",
        [oh.make_tensor_value_info("x", TP.FLOAT, ["N", 4]), oh.make_tensor_value_info("state", TP.FLOAT, ["S", "N", 4])],
        [oh.make_tensor_value_info("y", TP.FLOAT, ["N", 4]), oh.make_tensor_value_info("stateN", TP.FLOAT, ["S", "N", 4])],
        inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    return onnx.shape_inference.infer_shapes(model, data_prop=True)  # as tasks.sources.export.sanitize does


def _walk_graphs(g):
    yield g
    for n in g.node:
        for a in n.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from _walk_graphs(sub)


def test_if_branch_reads_outer_scope_tensors():
    fp32 = _if_model()
    onnx.checker.check_model(fp32, full_check=True)
    fp16, stats = _convert(fp32)
    _check_structure(fp32, fp16)
    assert stats["outer_scope_casts"] >= 2  # fp16 copy of `state`, fp32 copy of `hx` for Max
    # every outer-scope reference resolves to a tensor defined in an enclosing scope
    top = fp16.graph
    defined = {v.name for v in top.input} | {t.name for t in top.initializer} | {o for n in top.node for o in n.output}
    for g in list(_walk_graphs(top))[1:]:
        defined |= {o for n in g.node for o in n.output}
    for g in _walk_graphs(top):
        assert all(i in defined for n in g.node for i in n.input if i)
    rng = np.random.default_rng(7)
    feeds = {"x": rng.normal(size=(3, 4)).astype(np.float32), "state": rng.normal(size=(2, 3, 4)).astype(np.float32)}
    for a, b in zip(_ort_io(fp32, feeds), _ort_io(fp16, feeds)):
        assert b.dtype == np.float32 and _cosine(a, b) >= MIN_COSINE
    # the else branch too (state of another leading size)
    feeds["state"] = rng.normal(size=(3, 3, 4)).astype(np.float32)
    for a, b in zip(_ort_io(fp32, feeds), _ort_io(fp16, feeds)):
        assert _cosine(a, b) >= MIN_COSINE


def test_if_branch_reads_outer_scope_tensors_tensorrt_build():
    fp16, _ = _convert(_if_model())
    assert _trt_build(fp16, {"x": ((1, 4), (2, 4), (8, 4)), "state": ((2, 1, 4), (2, 2, 4), (3, 8, 4))}) > 0


def test_model_already_fp16_returned_unchanged():
    fp16_model, _ = _convert(_tiny_model())
    assert any(t.data_type == TP.FLOAT16 for t in fp16_model.graph.initializer)
    again, stats = _convert(fp16_model)  # no ValueError on an fp16 model
    assert stats["already_fp16"] and stats["fp16_tensors_before"] > 0
    assert again.SerializeToString() == fp16_model.SerializeToString()
    assert again is not fp16_model


def test_fp32_model_with_fp16_island_converts_the_rest():
    # Mostly fp32 weights plus an explicit fp16 part (Cast -> fp16 Mul -> Cast back).
    rng = np.random.default_rng(8)
    inits = [
        nh.from_array((rng.normal(size=(16, 16)) * 0.25).astype(np.float32), "w"),
        nh.from_array(np.array([0.5, 2.0] * 8, np.float16), "scale16"),
    ]
    nodes = [
        oh.make_node("MatMul", ["x", "w"], ["xw"], name="matmul"),
        oh.make_node("Cast", ["xw"], ["xw16"], to=TP.FLOAT16, name="to16"),
        oh.make_node("Mul", ["xw16", "scale16"], ["sc16"], name="mul16"),
        oh.make_node("Cast", ["sc16"], ["sc"], to=TP.FLOAT, name="to32"),
        oh.make_node("Relu", ["sc"], ["r"], name="relu"),
        oh.make_node("MatMul", ["r", "w"], ["y"], name="matmul2"),
    ]
    graph = oh.make_graph(
        nodes, "island", [oh.make_tensor_value_info("x", TP.FLOAT, ["N", 16])],
        [oh.make_tensor_value_info("y", TP.FLOAT, ["N", 16])], inits,
    )
    fp32 = onnx.shape_inference.infer_shapes(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8))
    fp16, stats = _convert(fp32)
    assert not stats["already_fp16"] and stats["fp16_tensors_before"] > 0
    _check_structure(fp32, fp16)
    inits16 = {t.name: t for t in fp16.graph.initializer}
    assert inits16["scale16"].data_type == TP.FLOAT16 and inits16["w"].data_type == TP.FLOAT16
    x = rng.normal(size=(5, 16)).astype(np.float32)
    a, b = _ort_io(fp32, {"x": x})[0], _ort_io(fp16, {"x": x})[0]
    assert b.dtype == np.float32 and _cosine(a, b) >= MIN_COSINE


def test_legacy_ir3_model_converts_to_a_loadable_fp16_model():
    # IR 3 lists initializers as graph inputs too; the converter retyped the weights but not those inputs, and
    # ONNX Runtime refused the result ("Tensor element type mismatch. 10 != 1").
    from tests.conftest import make_legacy_ir3_model

    fp32 = make_legacy_ir3_model()
    fp16, stats = _convert(fp32)
    assert fp16.ir_version == 4 and [i.name for i in fp16.graph.input] == ["x"]
    assert stats["fp16_nodes"] > 0
    x = np.random.default_rng(4).standard_normal((1, 3, 6, 6)).astype(np.float32)
    a, b = _ort_io(fp32, {"x": x})[0], _ort_io(fp16, {"x": x})[0]
    assert b.dtype == np.float32 and _cosine(a, b) >= MIN_COSINE
    assert _trt_build(fp16, {"x": ((1, 3, 6, 6),) * 3}) > 0


def test_model_with_fp16_weights_and_unsorted_nodes_passes_through():
    from tests.conftest import make_fp16_weights_unsorted_model

    raw = make_fp16_weights_unsorted_model()
    fp16, stats = _convert(raw)
    assert stats["already_fp16"]
    x = np.random.default_rng(6).standard_normal((3, 16)).astype(np.float32)
    assert _cosine(_ort_io(raw, {"x": x})[0], _ort_io(fp16, {"x": x})[0]) >= MIN_COSINE
    assert _trt_build(fp16, {"x": ((1, 16), (2, 16), (4, 16))}) > 0


def test_float_cast_inside_an_if_branch_is_retargeted():
    # Silero VAD v6: Cast(to=FLOAT) inside If branches. The converter declares its output fp16 but leaves to=FLOAT;
    # retargeting only the top-level graph leaves them, and ONNX Runtime refuses the fp16 model ("Type (tensor(float16))
    # of output arg ... does not match expected type (tensor(float))").
    rng = np.random.default_rng(9)
    c = nh.from_array((rng.standard_normal(4) * 0.5).astype(np.float32), "c")
    then = oh.make_graph([oh.make_node("Mul", ["x", "c"], ["m"], name="t_mul"),
                          oh.make_node("Cast", ["m"], ["mc"], to=TP.FLOAT, name="t_cast"),
                          oh.make_node("Relu", ["mc"], ["t_out"], name="t_relu")],
                         "then", [], [oh.make_tensor_value_info("t_out", TP.FLOAT, ["N", 4])])
    other = oh.make_graph([oh.make_node("Neg", ["x"], ["e_out"], name="e_neg")], "else", [],
                          [oh.make_tensor_value_info("e_out", TP.FLOAT, ["N", 4])])
    nodes = [oh.make_node("ReduceSum", ["x"], ["s"], keepdims=0, name="sum"),
             oh.make_node("Greater", ["s", "zero"], ["cond"], name="gt"),
             oh.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other, name="branch")]
    graph = oh.make_graph(nodes, "if_cast", [oh.make_tensor_value_info("x", TP.FLOAT, ["N", 4])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, ["N", 4])],
                          [c, nh.from_array(np.array(-1e9, np.float32), "zero")])
    fp32 = onnx.shape_inference.infer_shapes(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8))
    fp16, stats = _convert(fp32)
    assert stats["casts_retargeted"] >= 1
    x = rng.standard_normal((3, 4)).astype(np.float32)
    a, b = _ort_io(fp32, {"x": x})[0], _ort_io(fp16, {"x": x})[0]
    assert b.dtype == np.float32 and _cosine(a, b) >= MIN_COSINE


def test_a_model_converted_before_keeps_unique_names(tmp_path):
    """IS-Net fp16 was made by this converter's naming ('<node>_input_cast_0' tensors); converting its fp32 version
    again must not define those names twice (ONNX Runtime: 'Duplicate definition of name')."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    nodes = [helper.make_node("Relu", ["x"], ["r_input_cast_0"], name="relu"),
             helper.make_node("Resize", ["r_input_cast_0", "", "scales"], ["y"], mode="linear", name="r")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 8, 8])], [scales])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    h, _ = fp16_from_onnx(m)
    x = np.random.default_rng(0).standard_normal((1, 2, 4, 4)).astype(np.float32)
    y = ort.InferenceSession(h.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, ref, atol=1e-2)


def test_an_initializer_also_listed_as_an_input_feeding_a_blocked_and_a_converted_node_converts(tmp_path):
    """An older exporter's face detector (IR 4, initializers also graph inputs): a scale both a BatchNormalization (kept
    fp32) and a Mul (converted) read. ONNX Runtime refused the fp16 graph ("initializer ... has element type float16
    but usage of initializer in graph expects float") until the input entries went."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from tasks.engines.build import onnx_at_precision
    from tasks.sources.export import onnx_from_model

    rng = np.random.default_rng(0)
    c = 4
    inits = {"w": rng.standard_normal((c, 3, 3, 3)).astype(np.float32) * 0.3,
             "scale": (rng.random(c) + 0.5).astype(np.float32), "bias": np.zeros(c, np.float32),
             "mean": np.zeros(c, np.float32), "var": np.ones(c, np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["bn"]),
             helper.make_node("Unsqueeze", ["scale"], ["s3"], axes=[1, 2]),
             helper.make_node("Mul", ["bn", "s3"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])] + \
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in inits.items()]
    g = helper.make_graph(nodes, "old", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", c, 8, 8])],
                          initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 9)])
    m.ir_version = 4
    onnx.save(m, str(tmp_path / "old.onnx"))
    r = onnx_from_model({"format": "onnx", "source": str(tmp_path / "old.onnx")}, [], tmp_path / "m.onnx")
    assert any("initializers no longer listed as graph inputs" in n for n in r.details["sanitize"])
    fp16 = onnx_at_precision(r.files["onnx"], "fp16", tmp_path / "m16.onnx").files["onnx"]
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    sess = ort.InferenceSession(str(fp16), providers=["CPUExecutionProvider"])  # refused before
    ref = ort.InferenceSession(str(tmp_path / "old.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert _cosine(ref, sess.run(None, {"x": x})[0]) >= MIN_COSINE


def _output_read_inside_model():
    """x -> Conv -> y1 (a graph output, e.g. an audio CNN's intermediate embedding) -> Relu -> Conv -> y2: the
    converter casts y1 back to fp32 for the output, and its readers then got fp32 next to fp16 weights (TensorRT:
    "IConvolutionLayer `input` and `kernel` must be of same type. `input` type is Float but `kernel` is of type Half")."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32) * 0.2, "w1"),
             nh.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32) * 0.2, "w2")]
    nodes = [oh.make_node("Conv", ["x", "w1"], ["y1"], pads=[1, 1, 1, 1], name="conv1"),
             oh.make_node("Relu", ["y1"], ["r"], name="relu"),
             oh.make_node("Conv", ["r", "w2"], ["y2"], pads=[1, 1, 1, 1], name="conv2")]
    g = oh.make_graph(nodes, "outs", [oh.make_tensor_value_info("x", TP.FLOAT, ["n", 4, 8, 8])],
                      [oh.make_tensor_value_info("y1", TP.FLOAT, None), oh.make_tensor_value_info("y2", TP.FLOAT, None)],
                      inits)
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("keep", [{}, {"x": 1e5}, {"r": 1e5}])
def test_every_node_takes_one_float_type_and_tensorrt_builds_it(keep):
    """Kept nodes take fp32 on every float input, converted ones fp16 (weights too), whatever the converter left; the
    type check finds nothing, ONNX Runtime runs it, TensorRT-RTX builds it, and it computes what fp32 does."""
    from tasks.graph.types import mixed_input_types, value_types

    m = _output_read_inside_model()
    m16, stats = fp16_from_onnx(m, keep_fp32=keep)
    assert mixed_input_types(m16) == []
    types = value_types(m16)
    kept = set(stats["data_range"])  # the nodes the range check kept in fp32
    assert kept == {"x": {"conv1"}, "r": {"relu", "conv2"}}.get(next(iter(keep), None), set())
    for n in m16.graph.node:  # every float input of a layer has the layer's own type
        if n.op_type in ("Conv", "Relu"):
            want = TP.FLOAT if n.name in kept else TP.FLOAT16
            assert {types[i] for i in n.input} == {want}, (n.name, [types[i] for i in n.input])
    if not keep:
        assert not kept and stats["type_casts"] == 0  # the converted Relu reads the Conv's fp16 output directly
    x = np.random.default_rng(1).standard_normal((2, 4, 8, 8)).astype(np.float32)
    for a, b in zip(_ort_io(m, {"x": x}), _ort_io(m16, {"x": x})):
        assert _cosine(a, b) > MIN_COSINE
    assert _trt_build(m16, {"x": ((1, 4, 8, 8), (2, 4, 8, 8), (4, 4, 8, 8))}) > 0


def test_the_type_check_names_the_node_and_its_two_types(tmp_path):
    """A graph handing a Conv fp32 data and fp16 weights is refused before TensorRT, naming both (and how to go on)."""
    from tasks.engines.build import check_types
    from tasks.common.errors import SegmentBuildError

    m = _output_read_inside_model()
    w = m.graph.initializer[1]
    w.CopyFrom(nh.from_array(nh.to_array(w).astype(np.float16), "w2"))
    onnx.save(m, str(tmp_path / "mixed.onnx"))
    with pytest.raises(SegmentBuildError) as e:
        check_types(tmp_path / "mixed.onnx", 0, "build")
    assert "'conv2' (Conv)" in e.value.message and "'r' is float, 'w2' is float16" in e.value.message
    assert "partition.exclude_ops=[Conv]" in e.value.fix and e.value.segment == 0


def test_a_prequantized_encoders_divisions_take_one_type_at_fp16(tmp_path):
    """A speech encoder's class: uint8 Q/DQ (quantize_static's default) around a LayerNorm written with Div and a Div
    by a temperature; TensorRT-RTX refuses an fp16 graph whose Divs mix types ("ElementWiseOperation DIV must have same
    input types. But they are of types Half and Float"). Converted, every Div reads one type, and TensorRT builds it."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    from tasks.graph.types import mixed_input_types

    rng = np.random.default_rng(0)
    c, t = 8, 16
    nodes = [oh.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[0, 1, 0, 1], name="conv"),
             oh.make_node("Relu", ["c1"], ["r1"], name="relu"),
             oh.make_node("ReduceMean", ["r1"], ["mu"], axes=[-1], name="mean"),
             oh.make_node("Sub", ["r1", "mu"], ["d"], name="sub"),
             oh.make_node("Mul", ["d", "d"], ["d2"], name="square"),
             oh.make_node("ReduceMean", ["d2"], ["var"], axes=[-1], name="var"),
             oh.make_node("Add", ["var", "eps"], ["ve"], name="add_eps"),
             oh.make_node("Sqrt", ["ve"], ["sd"], name="sqrt"),
             oh.make_node("Div", ["d", "sd"], ["n"], name="div"),
             oh.make_node("MatMul", ["n", "w2"], ["m"], name="matmul"),
             oh.make_node("Div", ["m", "temp"], ["y"], name="div_temp")]
    g = oh.make_graph(nodes, "enc", [oh.make_tensor_value_info("x", TP.FLOAT, ["n", c, 1, t])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, ["n", c, 1, t])],
                      [nh.from_array((rng.standard_normal([c, c, 1, 3]) / 4).astype(np.float32), "w1"),
                       nh.from_array(np.zeros(c, np.float32), "b1"), nh.from_array(np.array(1e-5, np.float32), "eps"),
                       nh.from_array((rng.standard_normal([t, t]) / 4).astype(np.float32), "w2"),
                       nh.from_array(np.array(8.0, np.float32), "temp")])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 13)])
    m.ir_version = 7
    onnx.save(m, str(tmp_path / "float.onnx"))

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"x": rng.standard_normal([1, c, 1, t]).astype(np.float32)} for _ in range(4)])

        def get_next(self):
            return next(self.it, None)

    quantize_static(str(tmp_path / "float.onnx"), str(tmp_path / "qdq.onnx"), Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    op_types_to_quantize=["Conv", "MatMul", "Div", "Sub"])
    from tasks.prequant.rewrite import trt_from_prequantized

    q, _ = trt_from_prequantized(onnx.load(str(tmp_path / "qdq.onnx")))  # what export hands the build
    assert sum(n.op_type == "QuantizeLinear" for n in q.graph.node) >= 4
    m16, _ = fp16_from_onnx(q)
    assert mixed_input_types(m16) == []
    assert _trt_build(m16, {"x": ((1, c, 1, t), (2, c, 1, t), (4, c, 1, t))}) > 0
