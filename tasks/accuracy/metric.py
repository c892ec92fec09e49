"""Accuracy in the user's terms: the metric (``accuracy.metric``) that gates validate, the int8/fp8 accuracy search's
stopping point and the scheduled rebuild's regression check.

* ``cosine`` (the default): per output, the cosine of all its values pooled over the set (tasks/accuracy/metrics.py), gated on
  ``accuracy.min_cosine``.
* ``allclose``: an element is within tolerance when ``|candidate - reference| <= atol + rtol * |reference|`` (numpy's
  ``isclose``, Polygraphy's comparison; a non-finite candidate value is never within); per output the share of its
  elements within, pooled over the set, gated on ``accuracy.min_within`` (1.0: every element). ``accuracy.atol`` /
  ``accuracy.rtol`` apply to every output, ``accuracy.outputs.<name>.{atol,rtol}`` override them per output.
* ``top1``: per output, the share of rows (the last axis is the class axis) whose argmax agrees with the reference's,
  gated on ``accuracy.min_agreement``; outputs whose last axis has fewer than 2 entries are not judged.
* ``module:function``: the user's own, found like a torch factory (the working directory, then the config dir), called
  per batch as ``fn(outputs, references, feeds)`` (each a dict of output or input name to array) and returning
  ``(score, passed)``; the set passes when every batch does and reports the worst score (``accuracy.greater_is_better``
  says which way is worse). An exception in it, or a return value of another form, is a ConfigError naming it.

Every value names what measured it (the validate stage's source: ONNX Runtime's emulation or the engine). Outputs
produced by a final Softmax, Sigmoid or LogSoftmax are also judged on their logits (the input of that op) with cosine
and allclose (``logit_report``, logits.py); ``accuracy.gate_logits=true`` makes the logits gate too, and the verdict
names the level that gated.

The search (tasks/quantization/calibrate.py, tasks/quantization/sensitivity.py) sees a metric only through ``SearchJudge``: a value per feed
(higher is better) and a target on the same scale.

The metric is read from the config in config.py (the user's function imported there), validation.labels in
labels.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from tasks.common.errors import ConfigError
from tasks.accuracy.metrics import compare, cosine, summarize

from tasks.schema import ACCURACY_METRICS as BUILTIN
Feed = dict[str, np.ndarray]


@dataclass
class Metric:
    """One accuracy metric with its settings (``from_config``)."""

    name: str = "cosine"
    min_cosine: float = 0.99
    atol: float = 1e-5
    rtol: float = 1e-5
    outputs: dict[str, dict[str, float]] = field(default_factory=dict)  # per output {atol, rtol} overrides
    min_within: float = 1.0
    min_agreement: float = 0.99
    greater_is_better: bool = True
    gate_logits: bool = False
    fn: Callable | None = None
    origin: str | None = None  # the user function's module file

    # --- what it is ------------------------------------------------------------------------------------------
    @property
    def user(self) -> bool:
        return self.name not in BUILTIN

    def settings(self) -> dict[str, Any]:
        """The settings that decide this metric's verdict (summary.json, registry tag)."""
        if self.name == "cosine":
            s: dict[str, Any] = {"min_cosine": self.min_cosine}
        elif self.name == "allclose":
            s = {"atol": self.atol, "rtol": self.rtol, "min_within": self.min_within}
            if self.outputs:
                s["outputs"] = self.outputs
        elif self.name == "top1":
            s = {"min_agreement": self.min_agreement}
        else:
            s = {"function": self.name, "greater_is_better": self.greater_is_better}
        if self.gate_logits:
            s["gate_logits"] = True
        return s

    def rule(self) -> str:
        """The pass rule in words, with the config keys that set it."""
        if self.name == "cosine":
            return f"cosine >= accuracy.min_cosine={self.min_cosine}"
        if self.name == "allclose":
            per = "".join(f", {n}: atol={t.get('atol', self.atol)} rtol={t.get('rtol', self.rtol)}"
                          for n, t in self.outputs.items())
            return (f"share of elements within |candidate - reference| <= atol + rtol*|reference| (accuracy.atol="
                    f"{self.atol}, accuracy.rtol={self.rtol}{per}) >= accuracy.min_within={self.min_within}")
        if self.name == "top1":
            return f"top-1 (argmax of the last axis) agreement >= accuracy.min_agreement={self.min_agreement}"
        return f"{self.name} passes every batch"

    def tolerance(self, output: str, scale: float = 1.0) -> tuple[float, float]:
        t = self.outputs.get(output, {})
        return float(t.get("atol", self.atol)) * scale, float(t.get("rtol", self.rtol)) * scale

    def worse(self, a: float, b: float) -> float:
        """The worse of two scores."""
        return min(a, b) if self.greater_is_better else max(a, b)

    # --- one set ---------------------------------------------------------------------------------------------
    def evaluate(self, outputs: list[Feed], references: list[Feed], feeds: list[Feed],
                 labels: list[np.ndarray] | None = None) -> dict[str, Any]:
        """The metric over a set: ``{"metric", "settings", "rule", "score" (the worst), "passed", "outputs" {name:
        value} (built-in metrics), "per_sample" [...]}``. Per sample: each row of the batch axis for the built-in
        metrics (an output whose first dim is not the batch is judged per feed), each batch for a user function."""
        if self.user:
            return self._evaluate_user(outputs, references, feeds, labels)
        per_out: dict[str, list[float]] = {}  # pooled: [numerator, denominator] per output
        per_sample: list[dict] = []
        judged = set()
        for i, (got, ref, feed) in enumerate(zip(outputs, references, feeds)):
            n = samples_in(feed)
            names = []
            for name, r in ref.items():
                num, den = self._counts(name, got[name], r)
                if den == 0 and self.name == "top1":
                    continue
                judged.add(name)
                names.append(name)
                acc = per_out.setdefault(name, [0.0, 0.0])
                acc[0] += num
                acc[1] += den
            # per sample when every output has the batch axis first; else the feed is one entry
            split = n > 1 and all(np.ndim(ref[k]) > 0 and np.shape(ref[k])[0] == n and
                                  np.shape(got[k]) == np.shape(ref[k]) for k in names)
            for j in range(n if split else 1):
                row = {k: self._value(k, got[k][j], ref[k][j]) if split else self._value(k, got[k], ref[k])
                       for k in names}
                if row:
                    per_sample.append({"feed": i, **({"sample": j} if split or n == 1 else {"samples": n}),
                                       "score": min(row.values()), "outputs": row})
        if self.name == "cosine":
            stats = summarize(compare(r, o) for o, r in zip(outputs, references))
            values = {name: stats[name]["cosine"] for name in references[0]} if references else {}
        else:
            values = {name: (num / den if den else 1.0) for name, (num, den) in per_out.items()}
        if not values:
            raise ConfigError(f"accuracy.metric={self.name}: no output has a class axis to judge (the last axis of every "
                              f"output has fewer than 2 entries)", fix="use accuracy.metric=allclose or cosine")
        score = min(values.values())
        threshold = {"cosine": self.min_cosine, "allclose": self.min_within, "top1": self.min_agreement}[self.name]
        out = {"metric": self.name, "settings": self.settings(), "rule": self.rule(), "score": score,
               "passed": bool(score >= threshold), "threshold": threshold, "greater_is_better": True,
               "outputs": values, "per_sample": per_sample}
        if self.name == "top1" and set(references[0]) - judged:
            out["not_judged"] = sorted(set(references[0]) - judged)
        return out

    def _counts(self, name: str, c: np.ndarray, r: np.ndarray) -> tuple[float, float]:
        """(numerator, denominator) of the pooled value of one output on one feed (cosine: unused)."""
        if self.name == "allclose":
            within = within_tolerance(c, r, *self.tolerance(name))
            return float(within.sum()), float(within.size)
        if self.name == "top1":
            agree = top1_agreement(c, r)
            return (0.0, 0.0) if agree is None else (float(agree.sum()), float(agree.size))
        return 0.0, 0.0

    def _value(self, name: str, c: np.ndarray, r: np.ndarray, scale: float = 1.0) -> float:
        """The metric of one output on one feed or sample (higher is better)."""
        if self.name == "cosine":
            return cosine(c, r)
        if self.name == "allclose":
            within = within_tolerance(c, r, *self.tolerance(name, scale))
            return float(within.mean()) if within.size else 1.0
        agree = top1_agreement(c, r)
        return 1.0 if agree is None or not agree.size else float(agree.mean())

    def call(self, outputs: Feed, references: Feed, feed: Feed, labels: np.ndarray | None = None) -> tuple[float, bool]:
        """The user function on one batch: (score, passed); any exception or malformed answer is a ConfigError.
        ``labels`` (validation.labels: this batch's) is passed as a keyword only when given."""
        try:
            extra = {} if labels is None else {"labels": labels}
            got = self.fn(dict(outputs), dict(references), dict(feed), **extra)
        except Exception as e:  # noqa: BLE001 - the user's code: its failure is named, without a traceback
            raise ConfigError(f"accuracy.metric={self.name} raised {type(e).__name__}: {e}", file=self.origin, fix=f"fix {self.name} (called as fn(outputs, references, feeds), each "
                                                    "a dict of name to numpy array, returning (score, passed))") from None
        ok = isinstance(got, (tuple, list)) and len(got) == 2
        try:
            score, passed = (float(got[0]), got[1]) if ok else (None, None)
        except (TypeError, ValueError):
            ok = False
        if not ok or not isinstance(passed, (bool, np.bool_)):
            raise ConfigError(f"accuracy.metric={self.name} returned {got!r:.120}, not (score, passed)",
                              file=self.origin, fix="return a tuple (score: a number, passed: a bool) for each batch")
        return score, bool(passed)

    def _evaluate_user(self, outputs: list[Feed], references: list[Feed], feeds: list[Feed],
                       labels: list[np.ndarray] | None = None) -> dict[str, Any]:
        per_sample, score, passed = [], None, True
        for i, (got, ref, feed) in enumerate(zip(outputs, references, feeds)):
            s, p = self.call(got, ref, feed, None if labels is None else labels[i])
            per_sample.append({"feed": i, "samples": samples_in(feed), "score": s, "passed": p})
            score = s if score is None else self.worse(score, s)
            passed = passed and p
        return {"metric": self.name, "settings": self.settings(), "rule": self.rule(), "score": score,
                "passed": passed, "greater_is_better": self.greater_is_better, "per_sample": per_sample,
                "failed_batches": [x["feed"] for x in per_sample if not x["passed"]]}

    # --- the search ------------------------------------------------------------------------------------------
    def judge(self, margin_share: float = 0.0) -> "SearchJudge":
        """What the accuracy search judges a candidate with: a value per feed (higher is better) and its target.
        ``margin_share``: the share of the allowed error the search keeps in reserve
        (tasks.accuracy.budget.search_target with a budget of 0): cosine and top1 aim that share of (1 - threshold)
        above their threshold; allclose tightens its tolerances by it; a user function passes or not (1.0 / 0.0, target
        1.0)."""
        m = min(max(float(margin_share), 0.0), 1.0)
        if self.name == "cosine":
            from tasks.accuracy.budget import search_target
            return SearchJudge(self, "cosine", search_target(self.min_cosine, m), lambda o, r, f: min(
                cosine(o[k], r[k]) for k in r))
        if self.name == "allclose":
            return SearchJudge(self, f"allclose share of elements within tolerance (atol and rtol x{1 - m:.3g}: the "
                                     f"search's margin)", self.min_within,
                               lambda o, r, f: min(self._value(k, o[k], r[k], 1.0 - m) for k in r))
        if self.name == "top1":
            target = self.min_agreement + (1.0 - self.min_agreement) * m
            return SearchJudge(self, "top1 agreement", target, lambda o, r, f: min(self._value(k, o[k], r[k]) for k in r))
        return SearchJudge(self, f"{self.name} passing (1) or not (0)", 1.0,
                           lambda o, r, f: 1.0 if self.call(o, r, f)[1] else 0.0)


@dataclass
class SearchJudge:
    """The accuracy search's view of a metric: ``value(outputs, references, feed)`` per feed, higher is better; a
    candidate meets the budget when every held-out feed's value reaches ``target``."""

    metric: Metric
    label: str  # what the value is, in words ("cosine", "allclose share within", ...)
    target: float
    value: Callable[[Feed, Feed, Feed], float]

    @property
    def name(self) -> str:
        return self.metric.name

    def worst(self, outputs: list[Feed], references: list[Feed], feeds: list[Feed]) -> float:
        return min((self.value(o, r, f) for o, r, f in zip(outputs, references, feeds)), default=1.0)


def within_tolerance(c: np.ndarray, r: np.ndarray, atol: float, rtol: float) -> np.ndarray:
    """Elementwise |c - r| <= atol + rtol * |r| (shapes must agree). A non-finite candidate is never within, except
    where the reference holds the same non-finite value (NaN, +inf, -inf): those agree, as with numpy's
    ``equal_nan`` (tasks/accuracy/metrics.py ``finite_part`` leaves them out of the cosine)."""
    c = np.asarray(c, dtype=np.float64)
    r = np.asarray(r, dtype=np.float64)
    if c.shape != r.shape:
        return np.zeros(max(r.size, 1), dtype=bool)
    with np.errstate(invalid="ignore"):
        within = (np.abs(c - r) <= atol + rtol * np.abs(r)) & np.isfinite(c)
        if not within.all():
            within |= ~np.isfinite(r) & ((np.isnan(c) & np.isnan(r)) | (c == r))
        return within


def top1_agreement(c: np.ndarray, r: np.ndarray) -> np.ndarray | None:
    """Per row (all axes but the last), whether the argmax of the last axis agrees; None when there is no class axis."""
    r = np.asarray(r)
    if r.ndim == 0 or r.shape[-1] < 2:
        return None
    c = np.asarray(c)
    if c.shape != r.shape:
        return np.zeros(max(r.size // r.shape[-1], 1), dtype=bool)
    return np.argmax(c.reshape(-1, r.shape[-1]), axis=1) == np.argmax(r.reshape(-1, r.shape[-1]), axis=1)


def samples_in(feed: Feed) -> int:
    """The number of samples in a feed: the first axis of its first array that has one (1 when none has)."""
    a = next((a for a in feed.values() if np.ndim(a) > 0), None)
    return int(np.shape(a)[0]) if a is not None else 1
