"""The accuracy budget as the search and validate read it: how far above ``accuracy.min_cosine`` the search aims
(``derived_margin`` from the samples and candidates, or ``calibration.budget_margin`` as given, widened when few
samples judge it), and how many samples judge it.

The rule the search's figure follows (docs/accuracy.md, "The search's rule"): the graph the search keeps is the last of
about K judged candidates to meet its target on n held-out samples, judged alone from HELD_ALONE of them (calibration
samples judged beside fewer chose the ranges and drove the screening: no independent evidence). Its pooled error e (1 - cosine) is an estimate whose
relative standard error is at least 1/sqrt(n); picking among K candidates, the one kept may be one whose estimate was
lucky, so that with chance SEARCH_ALPHA at most over all K (Bonferroni) the error on fresh samples of the same kind
stays below e * (1 + z_K / sqrt(n)), z_K Student's t quantile of 1 - SEARCH_ALPHA / K with n - 1 degrees of freedom
(the standard error comes from the same n samples). Validate then measures m fresh
samples, whose own pooled error scatters by 1/sqrt(m) more: below e * (1 + z_K / sqrt(n)) * (1 + z_v / sqrt(m)) with
chance 1 - VALIDATE_ALPHA. The search aims so that this stays within the allowed error 1 - min_cosine; it already
lowers its figure by JUDGE_Z standard errors of the n_j samples it judges (at least e / sqrt(n_j) each), so the margin
is the rest: 1 - (1 + JUDGE_Z / sqrt(n_j)) / ((1 + z_K / sqrt(n)) * (1 + z_v / sqrt(m))). The figure holds on fresh
samples drawn like the held-out ones (same source, shapes and kind of content); samples whose errors spread more than
that floor widen the standard error the search subtracts, and pages unlike the held-out ones are not covered.
"""
from __future__ import annotations

from math import sqrt
from statistics import NormalDist

MARGIN_SAMPLES = 8  # held-out samples at which calibration.budget_margin applies as given
JUDGE_CALIBRATION = 8  # calibration feeds judged beside the held-out ones, where fewer than HELD_ALONE are held out
# held-out samples that judge the search alone: from 6 (5 degrees of freedom) the t quantile the margin allows for levels
# off (for 5% over 22 candidates: 12.1 at 2 samples, 7.3 at 3, 5.6 at 4, 4.8 at 5, 4.4 at 6, 3.9 at 9)
HELD_ALONE = 6

SEARCH_ALPHA = 0.05  # the chance, over all the candidates one search judges, that the kept graph's figure is too high
VALIDATE_ALPHA = 0.05  # the chance that validate's own samples alone put a graph that meets the budget below it
FIXED_MARGIN = 0.5  # fp16's search (its own held-out samples, few candidates), unless calibration.budget_margin is given
MAX_MARGIN = 0.9  # the margin derived never asks for more than 90% of the allowed error in reserve


def derived_margin(held_out: int, judged: int, candidates: int, validated: int | None, judge_z: float) -> float:
    """The share of the allowed error the search keeps in reserve (module docstring): from ``held_out`` (n, the
    samples the search judges that did not calibrate; the calibration samples themselves when none are held out),
    ``judged`` (n_j, every sample judged), ``candidates`` (K, whole judgements the search may make), ``validated`` (m,
    validate's samples; None: not counted) and ``judge_z`` (the standard errors the search subtracts). With 8 held out
    of 16 judged, 21 candidates and 6 validation samples: 0.69; 16 of 24, 16 validated: 0.53; 3 of 11: the cap."""
    n, nj = max(held_out, 1), max(judged, 1)
    z_k = student_t_quantile(1.0 - SEARCH_ALPHA / max(candidates, 1), n - 1)
    z_v = NormalDist().inv_cdf(1.0 - VALIDATE_ALPHA)
    need = (1.0 + z_k / sqrt(n)) * (1.0 + (z_v / sqrt(validated) if validated else 0.0))
    return min(max(1.0 - (1.0 + judge_z / sqrt(nj)) / need, 0.0), MAX_MARGIN)


def student_t_quantile(p: float, df: int) -> float:
    """Student's t quantile at ``p`` with ``df`` degrees of freedom, by the Cornish-Fisher expansion around the normal
    quantile (within 3% for df >= 4 at the quantiles used here; below, an underestimate that the margin's cap covers);
    the normal quantile for df <= 0 or large df. The standard error is estimated from the held-out samples themselves,
    so their small count widens the interval (with exponential per-sample errors, n = 4 and the normal quantile put 11% of
    searches over the budget on fresh samples, not 5%)."""
    z = NormalDist().inv_cdf(p)
    if df <= 0:
        return z
    v = float(df)
    return (z + (z ** 3 + z) / (4 * v) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * v ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * v ** 3))


def search_target(budget: float, margin: float, samples: int | None = None) -> float:
    """The cosine the search aims at: ``margin`` of the allowed error (1 - budget) above the budget, so the budget still
    holds when validate checks other samples and shapes (0.25 with budget 0.99 -> 0.9925). Judged on fewer than
    MARGIN_SAMPLES held-out samples the margin grows as 1/sqrt(samples) (the standard error of their mean): 2 samples
    double it (0.995)."""
    if samples:
        margin = margin * max(1.0, (MARGIN_SAMPLES / samples) ** 0.5)
    return min(1.0, budget + (1.0 - budget) * min(margin, 1.0))


def calibration_judged(held_out: int) -> int | None:
    """How many calibration samples (feeds) judge the search beside ``held_out`` held-out feeds: none from ``HELD_ALONE``
    held out (the calibration samples chose the ranges and drove the screening: in-sample, they flatter the pooled figure
    and are no evidence for the rule above), up to ``JUDGE_CALIBRATION`` below (a standard error of so few samples alone
    is too unsteady to judge by), all of them (None) when none are held out."""
    if not held_out:
        return None
    return 0 if held_out >= HELD_ALONE else JUDGE_CALIBRATION


def judged_samples(held_out: int, calibration: int, held_feeds: int | None = None) -> int:
    """How many samples judge the search (tasks/quantization/calibrate.py ``judge_feeds_of``): the ``held_out`` ones and
    ``calibration_judged`` of the calibration samples (decided on ``held_feeds``, the held-out feeds, as the search
    picks them; default: one sample each); the calibration samples alone when none are held out."""
    extra = calibration_judged(held_out if held_feeds is None else held_feeds)
    return calibration if extra is None else held_out + min(calibration, extra)
