import pytest

from tasks.common.errors import ConfigError
from tasks.graph.load import load_onnx
from tasks.graph.models import check_safe_name, graph_io, resolve_source


def test_pkg_source_resolves_without_importing_the_package():
    import sys

    p = resolve_source("pkg://rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx")
    assert p.is_file() and p.stat().st_size > 1_000_000
    assert "rapidocr_onnxruntime" not in sys.modules  # importing it would pull in cv2


@pytest.mark.parametrize("source, words", [
    ("pkg://no_such_package_xyz/model.onnx", "not installed"),
    ("pkg://rapidocr_onnxruntime/models/nope.onnx", "no file"),
    ("pkg://rapidocr_onnxruntime/../../etc/passwd", "leaves the package"),
    ("/nonexistent/model.onnx", "file not found"),
    (None, "not set"),
])
def test_bad_sources_say_what_and_how_to_fix(source, words):
    with pytest.raises(ConfigError) as e:
        resolve_source(source)
    assert words in str(e.value) and "fix:" in str(e.value)


def test_corrupt_onnx_is_refused_with_the_file_named(tmp_path):
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"\x08\x07garbage" * 100)
    with pytest.raises(ConfigError) as e:
        load_onnx(bad)
    assert "broken.onnx" in str(e.value)


@pytest.mark.parametrize("name", ["../evil", "a/b", "..", "", "x y"])
def test_names_that_would_leave_their_folder_are_refused(name):
    with pytest.raises(ConfigError):
        check_safe_name("model.name", name)


def test_graph_io_of_ppocr_det(det_path):
    ins, outs = graph_io(load_onnx(det_path))
    assert [i.name for i in ins] == ["x"] and ins[0].rank == 4 and ins[0].shape[1] == 3
    assert len(outs) == 1 and outs[0].dtype == "float32"


def external_matmul(tmp_path, rows: int, length: bool = True):
    """x[n, 1024] @ w[1024, rows] with w in a sparse external file (no disk, never read)."""
    import os

    import onnx
    from onnx import TensorProto, helper

    t = onnx.TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[1024, rows], data_location=TensorProto.EXTERNAL)
    for k, v in (("location", "w.bin"), ("offset", "0")) + ((("length", str(1024 * rows * 4)),) if length else ()):
        e = t.external_data.add()
        e.key, e.value = k, v
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1024])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", rows])
    m = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [t]),
                          opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(m, str(tmp_path / "m.onnx"))
    with open(tmp_path / "w.bin", "wb") as f:
        os.truncate(f.fileno(), 1024 * rows * 4)
    return tmp_path / "m.onnx"


@pytest.mark.parametrize("length", [True, False])
def test_a_model_past_protobufs_2gb_is_refused_before_its_weights_are_read(tmp_path, length):
    """2.2 GB of external weights (with and without a written length): refused naming the file, the size and what
    would fit, without reading the weights (the file is sparse: reading it would take seconds and 2 GB)."""
    import time

    path = external_matmul(tmp_path, 537_110, length)  # 2.2e9 bytes
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        load_onnx(path)
    assert time.monotonic() - t0 < 5
    msg = str(e.value)
    assert f"model.source: {path} holds 2.20 GB with its weights, past the 2 GB" in msg, msg
    assert "fix: export the model in parts under 2 GB each" in msg and "precision=fp16" in msg


def test_a_model_under_protobufs_limit_is_not_refused(tmp_path):
    from tasks.graph.load import stored_bytes

    path = external_matmul(tmp_path, 400_000)  # 1.64e9 bytes
    model = load_onnx(path, load_external_data=False)
    assert stored_bytes(model, tmp_path) == model.ByteSize() + 1024 * 400_000 * 4
