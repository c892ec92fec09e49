"""benchmarks/zoo.py on its small models: real packaged models through the real CLI, fp16 for sm_86."""
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
