"""benchmarks/zoo.py on its small models: real packaged models through the real CLI, fp16 for sm_86; its npm:// sources."""
import hashlib
import importlib.util
import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_small_zoo_models_build_at_fp16_within_the_accuracy_budget(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "zoo.py"), "--small", "--precisions", "fp16",
                           "--json", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    rows = json.loads(out.read_text())
    built = [r for r in rows if r["status"] != "not installed"]
    # squeezenet_ir3 (onnx) and ppocr_cls_v2 (rapidocr-onnxruntime) come with trtforge; the rest with --install
    assert {"squeezenet_ir3", "ppocr_cls_v2"} <= {r["model"] for r in built}, proc.stdout + proc.stderr
    for r in built:
        assert r["status"] == "ok", (r, proc.stdout[-3000:])
        assert r["cosine_min"] >= 0.99 and r["engines"] >= 1 and r["engine_bytes"] > 0, r
        # each stage's measured peak, none above the build's
        assert {"export", "build", "validate"} <= set(r["stage_peak_rss_mib"]), r
        assert all(0 < v <= r["peak_rss_mib"] for v in r["stage_peak_rss_mib"].values()), r
    assert "| model | precision | status |" in proc.stdout
    assert proc.returncode == 0


def test_npm_sources_are_pinned_and_their_chunks_checked():
    spec = importlib.util.spec_from_file_location("zoo", REPO / "benchmarks" / "zoo.py")
    zoo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zoo)
    assert zoo.parse_npm("npm://@imgly/background-removal-data@1.4.5/dist/resources.json#/models/small") == \
        ("@imgly/background-removal-data", "1.4.5", "dist/resources.json", "/models/small")
    assert zoo.parse_npm("npm://pkg@2.0.0/model.onnx") == ("pkg", "2.0.0", "model.onnx", "")
    for unpinned in ("npm://@imgly/background-removal-data/dist/resources.json", "npm://pkg/model.onnx"):
        with pytest.raises(ValueError, match="pinned version"):
            zoo.parse_npm(unpinned)

    data = bytes(range(256)) * 39 + bytes(16)  # 10,000 bytes
    parts = [data[:4096], data[4096:]]
    sha = [hashlib.sha256(c).hexdigest() for c in parts]
    listing = {"/models/m": {"chunks": [{"hash": sha[0], "offsets": [0, 4096]}, {"hash": sha[1], "offsets": [4096, 10_000]}],
                             "size": 10_000}}
    files = {f"dist/{h}": c for h, c in zip(sha, parts)} | {"dist/resources.json": json.dumps(listing).encode()}
    assert zoo.file_from_resources(files.__getitem__, "dist/resources.json", "/models/m") == data
    with pytest.raises(ValueError, match="has no resource"):
        zoo.file_from_resources(files.__getitem__, "dist/resources.json", "/models/x")
    files[f"dist/{sha[1]}"] = bytes([parts[1][0] ^ 1]) + parts[1][1:]  # a changed chunk
    with pytest.raises(ValueError, match="does not match its sha256"):
        zoo.file_from_resources(files.__getitem__, "dist/resources.json", "/models/m")


def test_an_input_fed_at_its_packages_scale_is_drawn_at_that_scale(tmp_path, monkeypatch):
    """openWakeWord feeds its mel front end 16-bit sample values; random standard-normal (or [0, 1)) data hid that the
    power spectrum overflows fp16. data.yaml's audio recipe draws whole sample values at that scale, for calibration
    and, with `scaled_only`, for validation; a model without an entry gets no validation data (as a user without data)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    spec = importlib.util.spec_from_file_location("zoo", REPO / "benchmarks" / "zoo.py")
    zoo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zoo)
    (tmp_path / "model").mkdir()
    g = helper.make_graph([helper.make_node("Identity", ["audio"], ["y"])], "g",
                          [helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["n", "t"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "t"])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "a.onnx"))
    for name in ("fed16", "plain"):
        (tmp_path / "model" / f"{name}.yaml").write_text(
            f"name: {name}\nsource: {tmp_path / 'a.onnx'}\nprofiles:\n"
            "  - audio: {min: [1, 1280], opt: [1, 1600], max: [4, 3200]}\n")
    (tmp_path / "data.yaml").write_text("fed16:\n  audio: {kind: audio, scale: 32767, peak: 0.6}\n")
    monkeypatch.setattr(zoo, "ZOO", tmp_path)
    monkeypatch.setattr(zoo, "DATA", tmp_path / "data.yaml")

    a = np.load(zoo.calibration_data("fed16", "batch", tmp_path))["audio"]
    assert a.shape == (16, 1600) and a.dtype == np.float32
    assert 19000 < np.abs(a).max() <= 0.6 * 32767 + 1 and np.array_equal(a, np.round(a))  # whole 16-bit values
    assert np.abs(a).mean() > 1000  # speech-like loudness, not a few spikes
    v = zoo.calibration_data("fed16", "batch", tmp_path, seed=1, purpose="validation", scaled_only=True)
    assert v.name == "fed16.validation.batch.npz" and not np.array_equal(np.load(v)["audio"], a)
    assert zoo.calibration_data("plain", "batch", tmp_path, purpose="validation", scaled_only=True) is None
    assert np.abs(np.load(zoo.calibration_data("plain", "batch", tmp_path))["audio"]).max() < 10  # standard normal


def test_a_graphs_edges_point_at_its_nodes_and_a_noise_level_is_positive(tmp_path, monkeypatch):
    """data.yaml's index kind: edges [2, E] into the nodes [N, F] of the same graph (in a stack of graphs, as the
    profile varies axes other than 0), segment ids sorted with every segment present; lognormal: positive values."""
    import numpy as np
    import onnx
    from onnx import TensorProto as TP, helper

    spec = importlib.util.spec_from_file_location("zoo", REPO / "benchmarks" / "zoo.py")
    zoo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zoo)
    (tmp_path / "model").mkdir()
    ins = [helper.make_tensor_value_info("x", TP.FLOAT, ["nodes", 4]), helper.make_tensor_value_info("edges", TP.INT64, [2, "e"]),
           helper.make_tensor_value_info("batch", TP.INT64, ["nodes"]), helper.make_tensor_value_info("slots", TP.FLOAT, ["g"]),
           helper.make_tensor_value_info("sigma", TP.FLOAT, ["g"])]
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", ins,
                          [helper.make_tensor_value_info("y", TP.FLOAT, ["nodes", 4])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "g.onnx"))
    (tmp_path / "model" / "gnn.yaml").write_text(
        f"name: gnn\nsource: {tmp_path / 'g.onnx'}\nprofiles:\n  - x: {{min: [2, 4], opt: [12, 4], max: [40, 4]}}\n"
        "    edges: {min: [2, 1], opt: [2, 30], max: [2, 90]}\n    batch: {min: [2], opt: [12], max: [40]}\n"
        "    slots: {min: [1], opt: [3], max: [4]}\n    sigma: {min: [1], opt: [3], max: [4]}\n")
    (tmp_path / "data.yaml").write_text("gnn:\n  edges: {kind: index, of: x}\n  batch: {kind: index, of: slots, sorted: true}\n"
                                        "  sigma: {kind: lognormal, mean: -0.9, std: 2.6}\n")
    monkeypatch.setattr(zoo, "ZOO", tmp_path)
    monkeypatch.setattr(zoo, "DATA", tmp_path / "data.yaml")
    d = np.load(zoo.calibration_data("gnn", "batch", tmp_path))
    assert d["x"].shape[1:] == (12, 4) and d["edges"].shape[1:] == (2, 30)  # a stack of graphs
    assert d["edges"].min() >= 0 and d["edges"].max() == 11
    b = d["batch"]
    assert (np.diff(b, axis=-1) >= 0).all() and all(set(row) == {0, 1, 2} for row in b)
    assert (d["sigma"] > 0).all() and d["sigma"].max() > 1 > d["sigma"].min()


def test_a_refusal_by_design_is_told_apart_from_an_error():
    spec = importlib.util.spec_from_file_location("zoo", REPO / "benchmarks" / "zoo.py")
    zoo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zoo)
    assert zoo.error_status("precision=int8: the model's quantization is dynamic (238 ops, run natively in ONNX "
                            "Runtime), so its TensorRT engines compute float, not int8") == "refused"
    assert zoo.error_status("[build] precision=fp32: ...") == "refused"
    assert zoo.error_status("calibration.data='/x.npz': no such file or folder") == "error"
