"""A torch model's graph exists only after export: what it shows its inputs mean (ids bounded by an embedding table) is
inferred from the exported ONNX, and the data is split again so its random sets are drawn in that domain and say so
(flows/config.py after_export); the memory check runs on the exported graph too."""
from __future__ import annotations

import textwrap
import uuid

import numpy as np

from flows.config import after_export, compose_config, preflight

ROWS = 40


def torch_conf(tmp_path):
    mod = f"ids_net_{uuid.uuid4().hex[:8]}"  # a module name of its own: the factory is imported by name
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / f"{mod}.py").write_text(textwrap.dedent(f"""
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = torch.nn.Embedding({ROWS}, 8)
                self.out = torch.nn.Linear(8, 4)

            def forward(self, ids):
                return self.out(self.emb(ids).mean(dim=1))

        def make():
            torch.manual_seed(0)
            return Net().eval()
    """))
    (conf / "model" / "idsnet.yaml").write_text(
        f"name: idsnet\nformat: torch\nfactory: \"{mod}:make\"\ninputs:\n  ids: {{shape: [1, 16], dtype: int64}}\n"
        "profiles:\n  - ids: {min: [1, 4], opt: [1, 16], max: [2, 32]}\n")
    return conf


def test_a_torch_model_s_inputs_get_the_domains_its_exported_graph_shows(tmp_path):
    from tasks.sources import onnx_from_model

    conf = torch_conf(tmp_path)
    cfg = compose_config(["model=idsnet", "precision=fp16", f"cache_dir={tmp_path / 'cache'}"], str(conf))
    inputs = preflight(cfg, str(conf))
    assert inputs.rules.domains == {} and inputs.memory_estimate is None  # no graph yet
    from omegaconf import OmegaConf
    r = onnx_from_model(OmegaConf.to_container(cfg.model, resolve=True), inputs.profiles, tmp_path / "x" / "model.onnx",
                        inputs.search)
    after = after_export(cfg, inputs, r.files["onnx"], None)
    d = after.rules.domains["ids"]
    assert d.kind == "ids" and d.high == ROWS
    val = after.data.validation
    note = next(n for n in val.notes if "domain the graph shows" in n)
    assert f"ids: ids in [0, {ROWS}), as it indexes an embedding table of {ROWS} rows" in note
    assert val.key["rules"]["domains"]["ids"]["high"] == ROWS  # part of validate's cache key
    ids = np.concatenate([f["ids"].ravel() for f in val.feeds])
    assert ids.max() < ROWS and ids.max() > 1  # inside the table, not the 0/1 of an input without meaning
    assert after.memory_estimate is not None and after.memory_estimate.weights > ROWS * 8 * 4  # checked on the graph
