"""How outputs are judged: cosine and error statistics, the user's metric (`accuracy.metric`), non-finite references, and the budget the searches aim at."""
from tasks.common.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "Metric": "metric",
    "cosine": "metrics",
    "final_activations": "logits",
    "fingerprint": "config",
    "from_config": "config",
    "judged_samples": "budget",
    "labels_per_feed": "labels",
    "nonfinite_reference": "nonfinite",
    "reference_warnings": "nonfinite",
    "load_labels": "labels",
    "search_target": "budget",
    "with_outputs": "logits",
})
