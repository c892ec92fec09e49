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
