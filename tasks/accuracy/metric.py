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
and allclose (``logit_report``); ``accuracy.gate_logits=true`` makes the logits gate too, and the verdict names the
level that gated.

The search (tasks/quantization/calibrate.py, tasks/quantization/sensitivity.py) sees a metric only through ``SearchJudge``: a value per feed
(higher is better) and a target on the same scale.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tasks.common.errors import ConfigError
from tasks.accuracy.metrics import compare, cosine, summarize

BUILTIN = ("cosine", "allclose", "top1")
LOGIT_OPS = ("Softmax", "Sigmoid", "LogSoftmax")
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
            n = _batch(feed)
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
            per_sample.append({"feed": i, "samples": _batch(feed), "score": s, "passed": p})
            score = s if score is None else self.worse(score, s)
            passed = passed and p
        return {"metric": self.name, "settings": self.settings(), "rule": self.rule(), "score": score,
                "passed": passed, "greater_is_better": self.greater_is_better, "per_sample": per_sample,
                "failed_batches": [x["feed"] for x in per_sample if not x["passed"]]}

    # --- the search ------------------------------------------------------------------------------------------
    def judge(self, margin_share: float = 0.0) -> "SearchJudge":
        """What the accuracy search judges a candidate with: a value per feed (higher is better) and its target.
        ``margin_share``: the share of the allowed error the search keeps in reserve (tasks/search.search_target with
        a budget of 0): cosine and top1 aim that share of (1 - threshold) above their threshold; allclose tightens
        its tolerances by it; a user function passes or not (1.0 / 0.0, target 1.0)."""
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
    """Elementwise |c - r| <= atol + rtol * |r| (a non-finite candidate is never within; shapes must agree)."""
    c = np.asarray(c, dtype=np.float64)
    r = np.asarray(r, dtype=np.float64)
    if c.shape != r.shape:
        return np.zeros(max(r.size, 1), dtype=bool)
    with np.errstate(invalid="ignore"):
        return (np.abs(c - r) <= atol + rtol * np.abs(r)) & np.isfinite(c)


def top1_agreement(c: np.ndarray, r: np.ndarray) -> np.ndarray | None:
    """Per row (all axes but the last), whether the argmax of the last axis agrees; None when there is no class axis."""
    r = np.asarray(r)
    if r.ndim == 0 or r.shape[-1] < 2:
        return None
    c = np.asarray(c)
    if c.shape != r.shape:
        return np.zeros(max(r.size // r.shape[-1], 1), dtype=bool)
    return np.argmax(c.reshape(-1, r.shape[-1]), axis=1) == np.argmax(r.reshape(-1, r.shape[-1]), axis=1)


def _batch(feed: Feed) -> int:
    a = next((a for a in feed.values() if np.ndim(a) > 0), None)
    return int(np.shape(a)[0]) if a is not None else 1


# --- config ---------------------------------------------------------------------------------------------------

def from_config(acc: Any, search: list[Path] | None = None) -> Metric:
    """The metric of ``accuracy`` (the typed config section, a DictConfig or a dict), checked: an unknown name, a
    ``module:function`` that cannot be imported, a negative tolerance or a threshold outside [0, 1] is a ConfigError
    naming the key, the value and the fix (before any heavy work)."""
    get = (lambda k, d=None: acc.get(k, d)) if isinstance(acc, dict) else (lambda k, d=None: getattr(acc, k, d))
    name = str(get("metric", "cosine") or "cosine")
    outputs = get("outputs") or {}
    outputs = {str(k): {kk: float(vv) for kk, vv in dict(v).items() if vv is not None} for k, v in dict(outputs).items()}
    m = Metric(name=name, min_cosine=float(get("min_cosine", 0.99)), atol=float(get("atol", 1e-5)),
               rtol=float(get("rtol", 1e-5)), outputs=outputs, min_within=float(get("min_within", 1.0)),
               min_agreement=float(get("min_agreement", 0.99)), greater_is_better=bool(get("greater_is_better", True)),
               gate_logits=bool(get("gate_logits", False)))
    for key in ("atol", "rtol"):
        v = getattr(m, key)
        if not (v >= 0 and math.isfinite(v)):
            raise ConfigError(f"accuracy.{key}={v} must be a finite number >= 0", fix=f"e.g. accuracy.{key}=1e-5")
        for out, t in outputs.items():
            if key in t and not (t[key] >= 0 and math.isfinite(t[key])):
                raise ConfigError(f"accuracy.outputs.{out}.{key}={t[key]} must be a finite number >= 0",
                                  fix=f"e.g. accuracy.outputs.{out}.{key}=1e-5")
    for out, t in outputs.items():
        if set(t) - {"atol", "rtol"}:
            raise ConfigError(f"accuracy.outputs.{out} has {sorted(set(t) - {'atol', 'rtol'})[0]!r}",
                              fix="per output, give atol and/or rtol")
    for key in ("min_within", "min_agreement"):
        v = getattr(m, key)
        if not 0.0 <= v <= 1.0:
            raise ConfigError(f"accuracy.{key}={v} is outside [0, 1]", fix=f"e.g. accuracy.{key}=0.99 (a share)")
    if outputs and name != "allclose":
        raise ConfigError(f"accuracy.outputs sets per-output tolerances, which only accuracy.metric=allclose uses "
                          f"(accuracy.metric={name})", fix="set accuracy.metric=allclose, or remove accuracy.outputs")
    if name in BUILTIN:
        return m
    mod_name, sep, fn_name = name.partition(":")
    if not sep or not mod_name or not fn_name:
        import difflib
        near = difflib.get_close_matches(name, BUILTIN, n=1)
        raise ConfigError(f"accuracy.metric={name!r} is unknown" + (f" (did you mean {near[0]!r}?)" if near else ""),
                          fix="use cosine, allclose, top1, or module:function (your own, in the working directory or "
                              "the config dir)")
    m.fn, m.origin = load_function(name, search)
    return m


def load_function(name: str, search: list[Path] | None = None) -> tuple[Callable, str | None]:
    """``module:function`` imported as a torch factory is (the working directory, then the config dir, on sys.path;
    the module imported fresh so that an edited file is what runs)."""
    from tasks.common.usermodules import add_import_paths, fresh_user_modules

    mod_name, _, fn_name = name.partition(":")
    add_import_paths(search)
    fresh_user_modules(mod_name, search)
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - ImportError, or the module's own error at import
        raise ConfigError(f"accuracy.metric={name!r} cannot be imported: {type(e).__name__}: {e}",
                          fix="put the module in the working directory or the config dir (--config-dir), or fix it"
                          ) from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"accuracy.metric={name!r}: module {mod_name!r} has no function {fn_name!r}",
                          file=getattr(mod, "__file__", None),
                          fix=f"define def {fn_name}(outputs, references, feeds): ... returning (score, passed)")
    return fn, getattr(mod, "__file__", None)


def fingerprint(acc: Any, search: list[Path] | None = None) -> dict | None:
    """What a user function's result depends on beyond the config: its module file's sha256 (None for built-ins)."""
    name = str((acc.get("metric") if isinstance(acc, dict) else getattr(acc, "metric", None)) or "cosine")
    if name in BUILTIN or ":" not in name:
        return None
    import importlib.util

    from tasks.common.usermodules import add_import_paths
    from tasks.common.util import sha256_file

    add_import_paths(search)
    try:
        spec = importlib.util.find_spec(name.partition(":")[0])
    except (ImportError, ValueError):
        spec = None
    origin = spec.origin if spec else None
    return {"metric": name, "module_sha256": sha256_file(origin) if origin and Path(origin).is_file() else None}


def load_labels(path: str, samples: int) -> np.ndarray:
    """validation.labels: one label per sample of validation.data (axis 0), checked against its sample count."""
    try:
        got = np.load(path, allow_pickle=False)
        if isinstance(got, np.lib.npyio.NpzFile):
            with got as z:
                if len(z.files) != 1:
                    raise ValueError(f"it holds {len(z.files)} arrays {z.files[:4]}, not one")
                got = z[z.files[0]]
    except (OSError, ValueError) as e:
        raise ConfigError(f"validation.labels={path!r} cannot be read: {e}", file=str(path),
                          fix="save one array of labels, one per sample of validation.data: numpy.save(path, labels)"
                          ) from None
    if got.ndim == 0 or len(got) != samples:
        raise ConfigError(f"validation.labels={path!r} holds {0 if got.ndim == 0 else len(got)} labels but "
                          f"validation.data holds {samples} samples", file=str(path),
                          fix="give one label per sample of validation.data, in its order (axis 0)")
    return got


def labels_per_feed(labels: np.ndarray, feeds: list[Feed]) -> list[np.ndarray]:
    """The labels of each feed's samples: validation.data's feeds are its samples in order, batch after batch."""
    out, at = [], 0
    for f in feeds:
        n = _batch(f)
        out.append(labels[at:at + n])
        at += n
    return out


# --- logits ---------------------------------------------------------------------------------------------------

def final_activations(model) -> dict[str, dict[str, str]]:
    """Graph outputs produced by a Softmax, Sigmoid or LogSoftmax (through Identity nodes): {output: {"op", "logits":
    the op's input}}."""
    import onnx

    m = onnx.load(str(model), load_external_data=False) if not isinstance(model, onnx.ModelProto) else model
    producer = {o: n for n in m.graph.node for o in n.output}
    out = {}
    for o in m.graph.output:
        n = producer.get(o.name)
        while n is not None and n.op_type == "Identity" and n.input:  # (exporters end graphs with an Identity)
            n = producer.get(n.input[0])
        if n is not None and n.op_type in LOGIT_OPS and n.input:
            out[o.name] = {"op": n.op_type, "logits": n.input[0]}
    return out


def with_outputs(model, names: list[str]):
    """A copy of ``model`` (a path or ModelProto) with ``names`` added as graph outputs (those it has as values)."""
    import onnx

    m = onnx.load(str(model)) if not isinstance(model, onnx.ModelProto) else model
    c = onnx.ModelProto()
    c.CopyFrom(m)
    have = {o.name for o in c.graph.output}
    values = {o for n in c.graph.node for o in n.output}
    for n in names:
        if n not in have and n in values:
            c.graph.output.append(onnx.ValueInfoProto(name=n))
    return c


def logit_report(metric: Metric, finals: dict[str, dict], outputs: list[Feed], references: list[Feed]) -> dict:
    """Per output from a final Softmax/Sigmoid/LogSoftmax: cosine (pooled) and allclose share (the metric's
    tolerances for that output) on its logits, and whether they meet the metric's rule at the logit level (cosine:
    min_cosine; allclose: min_within; other metrics: not applicable)."""
    out = {}
    for name, f in finals.items():
        t = f["logits"]
        pairs = [(o[t], r[t]) for o, r in zip(outputs, references) if t in o and t in r]
        if not pairs:
            continue
        a = np.concatenate([np.asarray(r, np.float64).ravel() for _, r in pairs])
        b = np.concatenate([np.asarray(c, np.float64).ravel() for c, _ in pairs])
        atol, rtol = metric.tolerance(name)
        within = within_tolerance(b, a, atol, rtol)
        row = {"op": f["op"], "logits": t, "cosine": cosine(b, a), "allclose_within": float(within.mean()),
               "atol": atol, "rtol": rtol, "max_abs": float(np.abs(a - b).max(initial=0))}
        if metric.name == "cosine":
            row["passed"] = row["cosine"] >= metric.min_cosine
        elif metric.name == "allclose":
            row["passed"] = row["allclose_within"] >= metric.min_within
        out[name] = row
    return out
