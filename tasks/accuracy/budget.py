"""The accuracy budget as the search and validate read it: how far above ``accuracy.min_cosine`` the search aims
(``calibration.budget_margin``, widened when few samples judge it), and how many samples judge it."""
from __future__ import annotations

MARGIN_SAMPLES = 8  # held-out samples at which calibration.budget_margin applies as given
JUDGE_CALIBRATION = 8  # calibration feeds judged beside the held-out ones

def search_target(budget: float, margin: float, samples: int | None = None) -> float:
    """The cosine the search aims at: ``margin`` of the allowed error (1 - budget) above the budget, so the budget still
    holds when validate checks other samples and shapes (0.25 with budget 0.99 -> 0.9925). Judged on fewer than
    MARGIN_SAMPLES held-out samples the margin grows as 1/sqrt(samples) (the standard error of their mean): 2 samples
    double it (0.995)."""
    if samples:
        margin = margin * max(1.0, (MARGIN_SAMPLES / samples) ** 0.5)
    return min(1.0, budget + (1.0 - budget) * min(margin, 1.0))


def judged_samples(held_out: int, calibration: int) -> int:
    """How many samples judge the search (tasks/quantization/calibrate.py): the held-out ones and up to ``JUDGE_CALIBRATION`` of the
    calibration samples; the calibration samples alone when none are held out."""
    return held_out + min(calibration, JUDGE_CALIBRATION) if held_out else calibration
