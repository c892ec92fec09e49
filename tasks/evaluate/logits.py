"""Outputs from a final Softmax/Sigmoid/LogSoftmax judged on their logits too: runners of the reference and the
candidate graph that also return the logits (the op's input), or why the candidate's cannot be read."""
from __future__ import annotations

from pathlib import Path

from tasks.accuracy.logits import final_activations, with_outputs


def logit_runners(reference: Path, candidates: list, identical: bool, hybrid: bool) -> dict | None:
    """``candidates``: (segment, engine, graph) of the deliverable; ``hybrid``: the model runs in several segments.
    None when no output comes from a final activation, or the candidate is the reference graph."""
    finals = final_activations(reference)
    if not finals or identical:
        return None
    names = [f["logits"] for f in finals.values()]
    if len(candidates) != 1 or hybrid:
        return {"finals": finals, "reason": "the model runs in several segments: its logits are not one graph's values"}
    from tasks.graph.load import load_onnx
    from tasks.onnxrt.emulate import precision_runner
    from tasks.onnxrt.ort import ort_runner

    cand = load_onnx(candidates[0][2])
    values = {o for n in cand.graph.node for o in n.output}
    missing = [n for n in names if n not in values]
    if missing:
        return {"finals": finals, "reason": f"the candidate graph has no tensor {missing[0]!r} (renamed by its conversion)"}
    ref_run = ort_runner(with_outputs(reference, names).SerializeToString(), stage="validate")
    cand_run = precision_runner(with_outputs(cand, names))[0]
    return {"finals": finals, "reference": lambda f: {k: v for k, v in ref_run(f).items() if k in names},
            "candidate": lambda f: {k: v for k, v in cand_run(f).items() if k in names}}
