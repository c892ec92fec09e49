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
