"""What to say when a build of a model that arrived quantized falls short of the model as shipped: the fix for a build
below its accuracy budget, and, for a dynamically quantized model built dequantized, how far its float form itself is
from the model as shipped."""
from __future__ import annotations


def accuracy_fix(q: dict) -> str:
    """How to fix a build of a pre-quantized model below its accuracy budget."""
    if q.get("requantized_pairs") or q.get("requantized_weights"):
        return ("its asymmetric pairs were requantized to symmetric int8, a different rounding than the model as shipped: "
                "lower accuracy.min_cosine if that agreement is acceptable, or use model.asymmetric=exact (the model's "
                "own rounding, int8 layers only where it folds exactly)")
    if q.get("shifted_pairs"):
        return ("its asymmetric pairs keep the model's own rounding as shifted int8 pairs; they differ from the model as "
                "shipped only where float rounding of the shift moves a value across a half step, which a model "
                "sensitive to single-step changes amplifies: lower accuracy.min_cosine if that agreement is acceptable, "
                "or try model.asymmetric=float (those pairs in float, not int8)")
    return "use a higher precision, or lower accuracy.min_cosine if that loss is acceptable"


def dequantized_vs_shipped(dequantized, shipped, feeds: list, metric=None) -> tuple[float, dict | None]:
    """How far apart the float model an engine computes (a dynamically quantized model's dequantized float form) and the
    model as shipped are on ``feeds``, both in ONNX Runtime (the shipped model quantizes its activations at run time;
    the float form does not): the lowest output cosine (pooled), and, for an ``accuracy.metric`` other than cosine
    (a tasks.accuracy.metric.Metric), its verdict on the float form against the shipped model ({"metric", "score",
    "passed", "rule"}; None for cosine)."""
    from tasks.accuracy.metrics import compare, headline, summarize
    from tasks.onnxrt.ort import ort_runner

    a, b = ort_runner(dequantized), ort_runner(shipped)
    outs, refs = [a(f) for f in feeds], [b(f) for f in feeds]
    cosine = headline(summarize([compare(r, o) for o, r in zip(outs, refs)]))["cosine_min"]
    if metric is None or metric.name == "cosine":
        return cosine, None
    try:
        judged = metric.evaluate(outs, refs, feeds)
    except Exception:  # noqa: BLE001 - e.g. a user function that needs labels: the fix then speaks of the cosine
        return cosine, None
    return cosine, {k: judged[k] for k in ("metric", "score", "passed", "rule") if k in judged}


def dequantized_fix(apart: float, random_inputs: bool, min_cosine: float, judged: dict | None = None) -> str:
    """What happened when a dynamically quantized model built dequantized (model.dequantize_dynamic=true) is compared
    with the model as shipped, and the choices; ``judged``: the user's accuracy.metric on the float form against the
    shipped model (dequantized_vs_shipped), which then decides instead of the cosine."""
    scale = (" These inputs are random values inside the profiles, not the model's real input scale: the shipped "
             "model's run-time activation quantization depends on the range it sees, so the distance on real data can "
             "be quite different." if random_inputs else "")
    short = not judged["passed"] if judged else apart < min_cosine
    verdict = ("no engine of it can agree more closely with the model as shipped" if short else
               "the rest of the loss is the engine's precision")
    by = (f" and scores {judged['score']:.6g} by accuracy.metric={judged['metric']} ({'fails' if short else 'meets'} "
          f"{judged['rule']})" if judged else "")
    return (f"the engine computes the float model that the dynamically quantized one approximates "
            f"(model.dequantize_dynamic=true), and that float model itself is at cosine {apart:.6f} to the model as "
            f"shipped on these inputs{by}: {verdict}.{scale} Validate on real inputs (validation.data=..., "
            f"calibration.data=...), or choose the reference knowingly: model.reference=dequantized validates against "
            f"the float form (what the engine computes; recorded in summary.json and the run), model.reference=shipped "
            f"(the default) against the model as shipped; or build it as shipped with model.dequantize_dynamic=false")
