"""Shared fixtures: real models (PP-OCRv4 from the installed package, tiny ones built in code), an isolated
MLflow store and Prefect home per session, and real TensorRT-RTX / ONNX Runtime everywhere."""
from __future__ import annotations

import atexit
import os
import tempfile
from pathlib import Path

_SESSION_TMP = Path(tempfile.mkdtemp(prefix="trtforge-tests-"))
os.environ["PREFECT_HOME"] = str(_SESSION_TMP / "prefect")
os.environ["PREFECT_LOCAL_STORAGE_PATH"] = str(_SESSION_TMP / "prefect" / "storage")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "90"
os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_SESSION_TMP / 'mlflow.db'}"
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
os.environ["DO_NOT_TRACK"] = "true"
os.environ["TRTFORGE_DAEMON"] = "0"  # CLI tests build in their own process; tests/flows/test_daemon.py turns it on
# the suite's runtime state (warm processes' sockets, locks, secrets) in folders of its own, never the user's
# (~/.cache/trtforge): a user's `python -m flows.local.daemon stop` cannot end the suite's warm process, and the suite
# stops none of the user's; the user's migrated templates are copied in (flows/local/templates.py: faster first starts)
_USER_TEMPLATES = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trtforge" / "templates"
os.environ["XDG_CACHE_HOME"] = str(_SESSION_TMP / "cache")
os.environ["XDG_RUNTIME_DIR"] = str(_SESSION_TMP / "run")
os.mkdir(_SESSION_TMP / "run", 0o700)
atexit.register(lambda: _remove_session_tmp())  # registered first, so it runs after every later exit handler
(_SESSION_TMP / "cache" / "trtforge" / "templates").mkdir(parents=True)
for _t in _USER_TEMPLATES.glob("*.db") if _USER_TEMPLATES.is_dir() else ():
    import shutil

    shutil.copyfile(_t, _SESSION_TMP / "cache" / "trtforge" / "templates" / _t.name)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PKG_MODELS = "pkg://rapidocr_onnxruntime/models/"

# In a parallel run (make test: pytest-xdist, --dist loadgroup) a file's tests share one worker, as its module fixtures
# expect; these files share one too: they act as the same other local user and look for that user's processes.
_SHARED_WORKER = {"test_local_isolation.py": "another-local-user", "test_local_isolation_ui.py": "another-local-user",
                  "test_local_state.py": "another-local-user"}


def _remove_session_tmp() -> None:
    if os.environ.get("TRTFORGE_KEEP_TEST_TMP") != "1":
        import shutil

        shutil.rmtree(_SESSION_TMP, ignore_errors=True)


def pytest_unconfigure(config):
    """The session's folder (MLflow store, Prefect home, models built in code: ~150 MB a run) goes with the session,
    after its fixtures have stopped the servers that used it, and again at exit (after the exit handlers that write to
    its cache); TRTFORGE_KEEP_TEST_TMP=1 keeps it to look into."""
    _remove_session_tmp()


def pytest_collection_modifyitems(config, items):
    for item in items:
        group = _SHARED_WORKER.get(item.path.name, str(item.path.relative_to(REPO)))
        item.add_marker(pytest.mark.xdist_group(group))


def pkg_model(name: str) -> Path:
    from tasks.graph.models import resolve_source

    return resolve_source(PKG_MODELS + name)


@pytest.fixture(scope="session")
def session_tmp() -> Path:
    return _SESSION_TMP


@pytest.fixture(scope="session")
def det_path() -> Path:
    return pkg_model("ch_PP-OCRv4_det_infer.onnx")


@pytest.fixture(scope="session")
def cls_path() -> Path:
    return pkg_model("ch_ppocr_mobile_v2.0_cls_infer.onnx")


def model_conf(root: Path, name: str, source: Path, profile: str) -> Path:
    """A user's config dir holding conf/model/<name>.yaml for ``source`` with one profile (its YAML flow mapping)."""
    d = root / "conf"
    (d / "model").mkdir(parents=True, exist_ok=True)
    (d / "model" / f"{name}.yaml").write_text(f"name: {name}\nsource: {source}\nprofiles:\n  - {profile}\n")
    return d


def make_conv_model(path: Path, channels: int = 8, custom_op: str | None = None, opset: int = 17) -> Path:
    """x[N,3,H,W] -> Conv -> Relu -> (optional custom op) -> Conv -> y. Weights seeded, dynamic N/H/W."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((channels, 3, 3, 3)).astype(np.float32) * 0.2, "w1")
    b1 = numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32) * 0.1, "b1")
    w2 = numpy_helper.from_array(rng.standard_normal((4, channels, 3, 3)).astype(np.float32) * 0.2, "w2")
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1")]
    mid = "r1"
    opsets = [helper.make_opsetid("", opset)]
    if custom_op:
        nodes.append(helper.make_node(custom_op, ["r1"], ["u1"], domain="trtforge.test", name="custom1"))
        opsets.append(helper.make_opsetid("trtforge.test", 1))
        mid = "u1"
    nodes.append(helper.make_node("Conv", [mid, "w2"], ["y"], pads=[1, 1, 1, 1], name="conv2"))
    return save_image_model(path, "tiny", nodes, [w1, b1, w2], 4, opsets)


def save_image_model(path: Path, name: str, nodes, initializers, out_channels: int, opsets) -> Path:
    """x[batch,3,height,width] -> nodes -> y[batch,out_channels,height,width], saved at IR 8."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", out_channels, "height", "width"])],
        initializer=initializers)
    model = helper.make_model(graph, opset_imports=opsets, producer_name="trtforge-tests")
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="session")
def tiny_onnx(session_tmp) -> Path:
    return make_conv_model(session_tmp / "tiny.onnx")


TINY_PROFILE = {"x": {"min": [1, 3, 8, 8], "opt": [2, 3, 16, 16], "max": [4, 3, 32, 32]}}


@pytest.fixture(scope="session")
def user_config_dir(session_tmp, tiny_onnx) -> Path:
    """A user's own --config-dir holding one model YAML (the way users add models)."""
    d = session_tmp / "userconf"
    (d / "model").mkdir(parents=True, exist_ok=True)
    (d / "model" / "tiny.yaml").write_text(
        "name: tiny\nformat: onnx\n"
        f"source: {tiny_onnx}\n"
        "profiles:\n  - x: {min: [1, 3, 8, 8], opt: [2, 3, 16, 16], max: [4, 3, 32, 32]}\n")
    return d


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


def make_hybrid_model(path: Path, contrib_ops=("FastGelu", "QuickGelu"), channels: int = 8) -> Path:
    """Conv blocks (Conv3x3 -> Relu -> Conv1x1) separated by ONNX Runtime contrib ops (com.microsoft) that the
    TensorRT parser cannot take: the shape of model that needs hybrid execution."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(1)
    inits, nodes = [], []
    cur, cin = "x", 3
    for b in range(len(contrib_ops) + 1):
        w1 = numpy_helper.from_array((rng.standard_normal((channels, cin, 3, 3)) * 0.3).astype(np.float32), f"b{b}_w1")
        w2 = numpy_helper.from_array((rng.standard_normal((channels, channels, 1, 1)) * 0.3).astype(np.float32), f"b{b}_w2")
        inits += [w1, w2]
        nodes += [helper.make_node("Conv", [cur, w1.name], [f"b{b}_c1"], pads=[1, 1, 1, 1], name=f"b{b}_conv3x3"),
                  helper.make_node("Relu", [f"b{b}_c1"], [f"b{b}_r"], name=f"b{b}_relu"),
                  helper.make_node("Conv", [f"b{b}_r", w2.name], [f"b{b}_out"], name=f"b{b}_conv1x1")]
        cur, cin = f"b{b}_out", channels
        if b < len(contrib_ops):
            op = contrib_ops[b]
            nodes.append(helper.make_node(op, [cur], [f"{op}_{b}"], domain="com.microsoft", name=f"contrib_{op}_{b}"))
            cur = f"{op}_{b}"
    nodes.append(helper.make_node("Identity", [cur], ["y"], name="out"))
    return save_image_model(path, "hybrid", nodes, inits, channels,
                            [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


@pytest.fixture(scope="session")
def hybrid_onnx(session_tmp) -> Path:
    return make_hybrid_model(session_tmp / "hybrid.onnx")


def make_two_input_model(path: Path, hidden: int = 16, vocab: int = 32) -> Path:
    """A transformer-like encoder layer with two inputs, as the legacy PyTorch exporter names them (each input's dims
    get their own names): input_ids and attention_mask [batch, seq] int64 -> embedding, single-head attention with
    the mask as an additive bias -> y [batch, seq, hidden]. Only the graph says their dims must agree."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(4)
    w = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
         for n, s in (("emb", (vocab, hidden)), ("wq", (hidden, hidden)), ("wk", (hidden, hidden)), ("wv", (hidden, hidden)))]
    w += [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("one", 1.0), ("neg", -1e4), ("scale", 0.25))]
    w += [numpy_helper.from_array(np.array([1], np.int64), "ax1")]
    mk = helper.make_node
    nodes = [mk("Gather", ["emb", "input_ids"], ["h"], name="embed"),
             mk("MatMul", ["h", "wq"], ["q"], name="q"), mk("MatMul", ["h", "wk"], ["k"], name="k"),
             mk("MatMul", ["h", "wv"], ["v"], name="v"),
             mk("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="kt"),
             mk("MatMul", ["q", "kt"], ["s0"], name="scores"), mk("Mul", ["s0", "scale"], ["s1"], name="scaled"),
             mk("Cast", ["attention_mask"], ["mf"], to=TensorProto.FLOAT, name="mask_float"),
             mk("Sub", ["one", "mf"], ["inv"], name="mask_inv"), mk("Mul", ["inv", "neg"], ["bias0"], name="mask_bias"),
             mk("Unsqueeze", ["bias0", "ax1"], ["bias"], name="mask_unsqueeze"),
             mk("Add", ["s1", "bias"], ["s2"], name="masked_scores"),
             mk("Softmax", ["s2"], ["p"], axis=-1, name="softmax"), mk("MatMul", ["p", "v"], ["y"], name="context")]
    graph = helper.make_graph(
        nodes, "two_input_encoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["input_ids_dim0", "input_ids_dim1"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["attention_mask_dim0", "attention_mask_dim1"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", hidden])], initializer=w)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="trtforge-tests")
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="session")
def two_input_conf(session_tmp) -> Path:
    """A user config dir with the two-input encoder, profiled the obvious way (both inputs alike)."""
    d = session_tmp / "twoinput"
    (d / "model").mkdir(parents=True, exist_ok=True)
    onnx_path = make_two_input_model(d / "encoder.onnx")
    rng = "{min: [1, 1], opt: [2, 16], max: [4, 32]}"
    (d / "model" / "encoder.yaml").write_text(
        f"name: encoder\nsource: {onnx_path}\nprofiles:\n  - input_ids: {rng}\n    attention_mask: {rng}\n")
    return d


def make_legacy_ir3_model() -> "onnx.ModelProto":
    """A model as ONNX model-zoo files of IR 3 / opset 9 are: Conv -> BatchNormalization -> Relu -> Gemm, with every
    initializer also listed as a graph input (required before IR 4)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    arrays = {"w": rng.standard_normal((4, 3, 3, 3)) * 0.3, "b": rng.standard_normal(4) * 0.1,
              "scale": 1 + rng.random(4), "bias": rng.standard_normal(4) * 0.1, "mean": rng.standard_normal(4) * 0.1,
              "var": 0.5 + rng.random(4), "fc_w": rng.standard_normal((4 * 6 * 6, 5)) * 0.1, "fc_b": np.zeros(5)}
    inits = [numpy_helper.from_array(a.astype(np.float32), k) for k, a in arrays.items()]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["bn"], name="bn"),
             helper.make_node("Relu", ["bn"], ["r"], name="relu"),
             helper.make_node("Flatten", ["r"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["y"], name="fc")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])]
    inputs += [helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.dims)) for t in inits]
    graph = helper.make_graph(nodes, "legacy", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], producer_name="trtforge-tests")
    model.ir_version = 3
    return model


def make_fp16_weights_unsorted_model() -> "onnx.ModelProto":
    """fp16 weights behind Cast(to=FLOAT) nodes (a model saved at half precision, computing in fp32), with its nodes
    stored out of topological order: ONNX Runtime and TensorRT take it, onnx.checker does not."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    w1 = numpy_helper.from_array((rng.standard_normal((16, 8)) * 0.3).astype(np.float16), "w1_fp16")
    w2 = numpy_helper.from_array((rng.standard_normal((8, 4)) * 0.3).astype(np.float16), "w2_fp16")
    nodes = [helper.make_node("MatMul", ["h", "w2"], ["y"], name="mm2"),  # consumers first
             helper.make_node("Relu", ["xw"], ["h"], name="relu"),
             helper.make_node("MatMul", ["x", "w1"], ["xw"], name="mm1"),
             helper.make_node("Cast", ["w2_fp16"], ["w2"], to=TensorProto.FLOAT, name="cast_w2"),
             helper.make_node("Cast", ["w1_fp16"], ["w1"], to=TensorProto.FLOAT, name="cast_w1")]
    graph = helper.make_graph(nodes, "half", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], initializer=[w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="trtforge-tests")
    model.ir_version = 8
    return model


IF_PROFILE = {"x": {"min": [1, 4], "opt": [2, 4], "max": [4, 4]}}


def make_if_model(path: Path) -> Path:
    """Two top-level Ifs on an int64 scalar input `mode` (16000 or not), like Silero VAD's sample rate. Their branches
    read outer values (x, y) by name and define the same name `t`; the first then-branch holds an If on a static
    shape (Gather(Shape(y), 1) == 4), which only folds once its branch is inlined."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def branch(name, nodes, out, inits=()):
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
                                 list(inits))

    c = lambda name, v: helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(v)))  # noqa: E731
    inner = helper.make_node("If", ["wide"], ["u"],
                             then_branch=branch("wide", [helper.make_node("Mul", ["t", "two"], ["u1"])], "u1"),
                             else_branch=branch("narrow", [helper.make_node("Neg", ["t"], ["u2"])], "u2"))
    then1 = branch("then1", [helper.make_node("Add", ["y", "w"], ["t"]), helper.make_node("Shape", ["y"], ["s"]),
                             c("one", np.int64(1)), helper.make_node("Gather", ["s", "one"], ["d"]),
                             c("four", np.int64(4)), helper.make_node("Equal", ["d", "four"], ["wide"]), inner], "u",
                   [numpy_helper.from_array(np.array([1, 2, 3, 4], np.float32), "w"),
                    numpy_helper.from_array(np.array(2, np.float32), "two")])
    else1 = branch("else1", [helper.make_node("Sub", ["y", "x"], ["t"])], "t")
    then2 = branch("then2", [helper.make_node("Mul", ["y", "y"], ["t"])], "t")
    else2 = branch("else2", [helper.make_node("Identity", ["x"], ["t"])], "t")
    nodes = [helper.make_node("Relu", ["x"], ["y"]), c("k", np.int64(16000)),
             helper.make_node("Equal", ["mode", "k"], ["is16k"]),
             helper.make_node("If", ["is16k"], ["a"], then_branch=then1, else_branch=else1, name="first"),
             helper.make_node("If", ["is16k"], ["b"], then_branch=then2, else_branch=else2, name="second"),
             helper.make_node("Add", ["a", "b"], ["out"])]
    g = helper.make_graph(nodes, "if_model", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
                                              helper.make_tensor_value_info("mode", TensorProto.INT64, [])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 4])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="session")
def if_onnx(session_tmp) -> Path:
    return make_if_model(session_tmp / "if_model.onnx")


def make_audio_power_model(path: Path) -> Path:
    """A mel-spectrogram-like front end: x[N,1,T] (audio at 16-bit sample scale) -> Conv1d (a filter bank) -> Mul(c, c)
    (power) -> Add(eps) -> Log -> Conv1d -> y. On real-scale audio the filter outputs exceed fp16's range (~1e5) and the
    power ~1e10: a naive fp16 graph gives inf; on random values in [0, 1) nothing overflows."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)
    w1 = numpy_helper.from_array((rng.standard_normal((8, 1, 9)) * 0.5).astype(np.float32), "fb")
    w2 = numpy_helper.from_array((rng.standard_normal((4, 8, 1)) * 0.3).astype(np.float32), "proj")
    eps = numpy_helper.from_array(np.array(1e-6, np.float32), "eps")
    nodes = [helper.make_node("Conv", ["x", "fb"], ["bank"], pads=[4, 4], name="filterbank"),
             helper.make_node("Mul", ["bank", "bank"], ["power"], name="power"),
             helper.make_node("Add", ["power", "eps"], ["power_eps"], name="floor"),
             helper.make_node("Log", ["power_eps"], ["logmel"], name="log"),
             helper.make_node("Conv", ["logmel", "proj"], ["y"], name="proj")]
    g = helper.make_graph(nodes, "mel", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1, "t"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, "t"])], initializer=[w1, w2, eps])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    import onnx
    onnx.save(m, str(path))
    return path


def audio_16bit(n: int, t: int = 256, seed: int = 0) -> np.ndarray:
    """Speech-like audio at the scale a 16-bit front end is fed (sample values up to ~+-20000)."""
    rng = np.random.default_rng(seed)
    k = np.arange(t)
    x = [np.sin(2 * np.pi * rng.uniform(0.01, 0.2) * k) * rng.uniform(5000, 20000) + rng.normal(0, 300, t)
         for _ in range(n)]
    return np.asarray(x, np.float32)[:, None, :]


@pytest.fixture(scope="session", autouse=True)
def stop_the_shared_prefect_server():
    """Builds started by the tests share one local Prefect server (flows/local/server.py) under the session's PREFECT_HOME:
    stopped when the session ends, so nothing outlives the suite."""
    yield
    from flows.local.server import shutdown

    shutdown()


@pytest.fixture(autouse=True)
def stop_the_servers_a_test_started(request):
    """A test whose CLI builds used a Prefect home of its own (tmp_path/...): that home's shared server stops with the
    test instead of idling on for TRTFORGE_SERVER_IDLE seconds."""
    tmp = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None  # (held past yield)
    yield
    if tmp is not None:
        from flows.local.server import shutdown

        for record in tmp.glob("*/trtforge-server.json"):
            shutdown(record.parent)
