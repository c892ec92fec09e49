"""An int8 build whose accuracy search cannot quantize any layer within the budget (real Prefect, a real MLflow store,
real ONNX Runtime): the error names the closest layers, their figures and what would pass; the failed result folder
keeps the sensitivity table and the search's figures."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.flows.test_build_flow import build


@pytest.mark.slow  # a whole flow
def test_a_refused_search_names_the_closest_layers_and_keeps_its_report(prefect_harness, user_config_dir, tmp_path):
    np.savez(tmp_path / "data.npz", x=np.random.default_rng(2).standard_normal((12, 3, 16, 16)).astype(np.float32))
    s = build(["model=tiny", "precision=int8", f"calibration.data={tmp_path / 'data.npz'}",
               "accuracy.min_cosine=0.99999", "calibration.budget_margin=0", "stages.benchmark=false"],
              user_config_dir, tmp_path)
    assert s["status"] == "failed" and s["stages"]["calibrate"]["status"] == "failed", s["stages"]
    reason = s["stages"]["calibrate"]["reason"]
    assert "no layer can be quantized to int8" in reason and "Closest, each quantized alone: " in reason, reason
    assert "a search target of at most" in reason and "accuracy.min_cosine=" in reason, reason
    failed = Path(s["out_dir"])
    assert failed.name == "int8.failed", failed
    rows = json.loads((failed / "sensitivity.json").read_text())
    assert len(rows["layers"]) == 2 and all(r["local_error"] is not None for r in rows["layers"]), rows
    closest = rows["segments"][0]["closest"]
    assert closest and closest[0]["node"] in reason and f"{closest[0]['bound']:.6f}" in reason
    m = s["metrics"]  # the search's figures, measured
    assert m["quantized_layers"] == 0 and m["fallback_layers"] == 2 and 0.9 < m["search_cosine_all_quantized"] < 0.99999
    assert json.loads((failed / "summary.json").read_text())["metrics"]["search_cosine_all_quantized"] == \
        m["search_cosine_all_quantized"]
