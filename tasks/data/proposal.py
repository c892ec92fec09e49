"""Shape profiles proposed from real traffic (tasks/data/traffic.py reads it), or the given ones checked against it.

``propose`` groups the requests into 1..K profiles:

* the cost of a request is its FLOPs (tasks/trt/network.py's model, estimated on the graph at that shape; interpolated in
  log-log from exact estimates at up to ``EXACT_COSTS`` shapes when there are more), or, without a graph, its input
  elements;
* rare requests beyond the coverage target are left out (the rarest first, the costliest first among equally rare)
  and listed as outliers; so are requests whose own activation memory exceeds ``max_activation_mib``;
* the rest are split into boxes, one axis-aligned cut at a time (the cut, of any box along any dim at any value
  between requests, that lowers the objective most), so the boxes never overlap and each request is served by its own
  box's profile. The objective: the mean over requests of |log(cost / cost of its profile's opt)|, with ``opt`` the
  box's count-weighted median request by cost (a real request shape, so on every stride and with tied dims equal);
  ``min``/``max`` are the box's elementwise bounds. A box is not allowed when its max holds more than ``MAX_SLACK``
  times the input elements of its largest request (bounds of unlike shapes multiply) or would exceed the activation
  budget: cuts remove those first;
* K, when not given, is the smallest whose next profile improves the objective by less than ``K_GAIN`` (each profile
  costs build time and engine size: TensorRT tunes kernels per profile).

Activation memory is the peak of live intermediate tensors (fp32, graph order, a tensor freed after its last reader)
from ONNX shape inference at the shape: an estimate of what an engine's activations need, before TensorRT's own
fusion and reuse.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from tasks.common.errors import ConfigError
from tasks.graph.flops import inferred_at, onnx_flops
from tasks.graph.models import TensorInfo
from tasks.data.traffic import Shape, Traffic, check_rules, read_traffic, serving, traffic_path, varying_dims

EXACT_COSTS = 24  # exact FLOP estimates (one ONNX shape inference each); more unique shapes are interpolated
MAX_PROFILES = 4
K_GAIN = 0.25  # a further profile must cut the objective by at least this share
MAX_SLACK = 1.5  # a profile's max holds at most this many times the input elements of its largest request


def from_config(traffic_cfg: dict, inputs: list[TensorInfo], model, profiles: list[dict], multiples: dict,
                ties: list, search: list[Path] | None = None) -> tuple[Traffic, "Proposal"]:
    """The traffic of ``model.traffic`` checked against the model (inputs, given multiples, ties), and the profiles it
    proposes, or, when ``profiles`` are given (they win), their coverage of it."""
    from tasks.data.profiles import ShapeRules

    traffic = read_traffic(traffic_path(traffic_cfg["source"], search), inputs)
    check_rules(traffic, ShapeRules([t for t in ties if t.hard], multiples))
    if profiles:
        return traffic, check_given(traffic, profiles)
    return traffic, propose(traffic, model, traffic_cfg.get("profiles"), float(traffic_cfg.get("coverage", 0.999)),
                            traffic_cfg.get("max_activation_mib"))



# -- costs -------------------------------------------------------------------------------------------------------------

def _elements(s: Shape) -> float:
    return float(sum(math.prod(v) for v in s.values()))


def activation_mib(model, shapes: Shape) -> float | None:
    """Peak live intermediate memory at ``shapes`` (fp32 bytes, graph order, freed after the last reader), in MiB;
    None when shapes cannot be inferred."""
    m = inferred_at(model, shapes) if model is not None else None
    if m is None:
        return None
    g = m.graph
    size = {}
    for v in (*g.input, *g.value_info, *g.output):
        dims = [d.dim_value for d in v.type.tensor_type.shape.dim]
        if dims and all(d > 0 for d in dims) or not dims and v.type.tensor_type.HasField("shape"):
            size[v.name] = 4.0 * math.prod(dims)
    weights = {t.name for t in g.initializer}
    last: dict[str, int] = {}
    for i, n in enumerate(g.node):
        for x in n.input:
            last[x] = i
    outputs = {o.name for o in g.output}
    live = {i.name: size.get(i.name, 0.0) for i in g.input if i.name not in weights}
    peak = sum(live.values())
    for i, n in enumerate(g.node):
        for o in n.output:
            if o and o not in weights:
                live[o] = size.get(o, 0.0)
        peak = max(peak, sum(live.values()))
        for x in n.input:
            if last.get(x) == i and x not in outputs:
                live.pop(x, None)
    return peak / 2**20


class Costs:
    """FLOPs per request shape (or input elements without a graph), exact at up to EXACT_COSTS shapes."""

    def __init__(self, model, shapes: list[Shape]):
        self.unit = "FLOPs" if model is not None else "input elements"
        elems = np.array([_elements(s) for s in shapes])
        if model is None:
            self.values, self.how = elems, "input elements (no graph to estimate FLOPs on)"
            return
        order = np.argsort(elems, kind="stable")
        pick = sorted(set(order[np.linspace(0, len(order) - 1, min(EXACT_COSTS, len(order))).round().astype(int)]))
        exact = {}
        for i in pick:
            f = sum(onnx_flops(model, {n: list(v) for n, v in shapes[i].items()}).values())
            if f > 0:
                exact[i] = f
        if not exact:
            self.values, self.unit, self.how = elems, "input elements", "input elements (FLOPs could not be estimated)"
            return
        if len(exact) == len(shapes):
            self.values, self.how = np.array([exact[i] for i in range(len(shapes))]), f"estimated FLOPs at {len(shapes)} shapes"
            return
        xs, ys = np.log([elems[i] for i in exact]), np.log(list(exact.values()))
        slope, icpt = np.polyfit(xs, ys, 1) if len(exact) > 1 and np.ptp(xs) > 0 else (1.0, ys[0] - xs[0])
        self.values = np.array([exact.get(i, math.exp(icpt + slope * math.log(elems[i]))) for i in range(len(shapes))])
        self.how = f"estimated FLOPs at {len(exact)} shapes, the other {len(shapes) - len(exact)} interpolated (log-log)"


# -- the proposal ------------------------------------------------------------------------------------------------------

@dataclass
class Proposal:
    profiles: list[dict]  # [{input: {"min", "opt", "max"}}]
    requests: int
    covered: int
    per_profile: list[int]  # requests each profile serves (the first profile containing a request, as the runtime picks)
    outliers: list[dict]  # [{input: shape, "count": n, "why": ...}]
    objective: dict[int, float]  # K -> mean |log(cost / opt cost)|
    k: int
    k_reason: str
    cost_how: str
    activation_mib: list[float | None] = field(default_factory=list)  # per profile, at its max
    opt_distance: float | None = None  # mean |cost - opt cost| / opt cost over covered requests

    @property
    def coverage(self) -> float:
        return self.covered / self.requests if self.requests else 0.0

    def as_dict(self) -> dict:
        return {"requests": self.requests, "coverage": self.coverage, "profiles": self.profiles,
                "outliers": self.outliers, "per_profile": self.per_profile, "k": self.k, "k_reason": self.k_reason,
                "objective": {str(k): v for k, v in self.objective.items()}, "cost": self.cost_how,
                "activation_mib_at_max": self.activation_mib, "opt_flops_distance": self.opt_distance}



def _weighted_median(idx: list[int], costs: np.ndarray, counts: np.ndarray) -> int:
    idx = sorted(idx, key=lambda i: costs[i])
    total, acc = counts[idx].sum(), 0
    for i in idx:
        acc += counts[i]
        if acc * 2 >= total:
            return i
    return idx[-1]


def _group_cost(idx: list[int], costs: np.ndarray, counts: np.ndarray) -> float:
    o = _weighted_median(idx, costs, counts)
    return float((counts[idx] * np.abs(np.log(costs[idx] / costs[o]))).sum())


def _box(shapes: list[Shape], idx: list[int], opt: int) -> dict:
    names = list(shapes[idx[0]])
    return {n: {"min": [int(min(shapes[i][n][d] for i in idx)) for d in range(len(shapes[idx[0]][n]))],
                "opt": [int(v) for v in shapes[opt][n]],
                "max": [int(max(shapes[i][n][d] for i in idx)) for d in range(len(shapes[idx[0]][n]))]} for n in names}



def propose(traffic: Traffic, model=None, k: int | None = None, coverage: float = 0.999,
            max_activation_mib: float | None = None) -> Proposal:
    """1..K profiles for ``traffic`` (see the module doc): the outliers left out, the rest cut into boxes, K chosen."""
    if not 0.0 < coverage <= 1.0:
        raise ConfigError(f"model.traffic.coverage={coverage} is outside (0, 1]", fix="e.g. 0.999")
    if k is not None and not 1 <= k <= 16:
        raise ConfigError(f"model.traffic.profiles={k} is outside 1..16", fix="e.g. 2, or leave it out to let trtforge choose")
    shapes, counts = traffic.shapes, np.array(traffic.counts, dtype=np.int64)
    costs_ = Costs(model, shapes)
    costs = np.maximum(costs_.values, 1e-9)
    act, act_note = _activation_estimate(model, shapes, max_activation_mib)
    lead = varying_dims(traffic, top=None, order="input")[:1]  # the first dim that varies (batch, usually)
    outliers = _outliers(traffic, counts, costs, coverage, act, max_activation_mib, lead)
    kept = sorted((i for i in range(len(shapes)) if i not in outliers),
                  key=lambda i: (*(shapes[i][n][d] for n, d in lead), costs[i], _elements(shapes[i])))
    if not kept:
        raise ConfigError(f"model.traffic: no request is left to profile ({len(outliers)} outliers)",
                          fix="raise model.traffic.max_activation_mib or lower model.traffic.coverage")
    steps = _cuts(traffic, counts, costs, kept, k, act, max_activation_mib)
    objective, chosen, reason = _choose_k(steps, k, max_activation_mib)
    groups = sorted(steps[chosen][0], key=lambda g: (*(shapes[_weighted_median(g, costs, counts)][n][d] for n, d in lead),
                                                     costs[_weighted_median(g, costs, counts)]))
    profiles, opts = [], []
    for idx in groups:
        o = _weighted_median(idx, costs, counts)
        opts.append(o)
        profiles.append(_box(shapes, idx, o))
    per = [0] * len(profiles)
    covered, dist = 0, 0.0
    for i, s in enumerate(shapes):
        p = serving(profiles, s)
        if p is not None:
            per[p] += int(counts[i])
            covered += int(counts[i])
            dist += counts[i] * abs(costs[i] - costs[opts[p]]) / costs[opts[p]]
    out = [{**{n: list(shapes[i][n]) for n in traffic.names}, "count": int(counts[i]), "why": why}
           for i, why in sorted(outliers.items(), key=lambda t: -counts[t[0]]) if serving(profiles, shapes[i]) is None]
    acts = [activation_mib(model, {n: tuple(r["max"]) for n, r in p.items()}) if model is not None else None
            for p in profiles]
    return Proposal(profiles, traffic.requests, covered, per, out, objective, chosen, reason + act_note, costs_.how, acts,
                    dist / covered if covered else None)


def _activation_estimate(model, shapes: list[Shape],
                         max_activation_mib: float | None) -> tuple[Callable[[Shape], float | None], str]:
    """(each shape's activation memory, None where not applied; a note when the budget cannot be applied).
    Activation memory grows with the input elements (conv nets: linearly): estimated from one exact value at the
    largest request, so the search can test every candidate group; the chosen profiles get exact values."""
    act_note = ""
    per_element = None
    if max_activation_mib is not None:
        ref = max(range(len(shapes)), key=lambda i: _elements(shapes[i]))
        ref_mib = activation_mib(model, shapes[ref]) if model is not None else None
        if ref_mib is None:
            act_note = "; max_activation_mib not applied: activation memory cannot be estimated without the graph's shapes"
        else:
            per_element = ref_mib / _elements(shapes[ref])

    def act(s: Shape) -> float | None:
        return None if per_element is None else per_element * _elements(s)

    return act, act_note


def _outliers(traffic: Traffic, counts: np.ndarray, costs: np.ndarray, coverage: float,
              act: Callable[[Shape], float | None], max_activation_mib: float | None,
              lead: list[tuple[str, int]]) -> dict[int, str]:
    """{request: why it is left out}: those beyond the activation budget, then the rare ones beyond ``coverage``
    (the rarest, costliest first) that lie outside the bounds of the others of their batch."""
    shapes = traffic.shapes
    outliers: dict[int, str] = {}
    for i, s in enumerate(shapes):
        a = act(s)
        if a is not None and a > max_activation_mib:
            outliers[i] = f"needs ~{a:.0f} MiB of activations > max_activation_mib={max_activation_mib:g}"
    budget = int(math.floor((1.0 - coverage) * traffic.requests + 1e-9)) - int(counts[list(outliers)].sum())
    flat = np.array([[v for n in traffic.names for v in s[n]] for s in shapes])
    lead_of = [tuple(s[n][d] for n, d in lead) for s in shapes]
    for i in sorted(range(len(shapes)), key=lambda i: (counts[i], -costs[i])):  # rarest, costliest first
        if i in outliers:
            continue
        if counts[i] > budget:
            break
        # only an extreme is worth leaving out: a request inside the bounds of the others of its batch costs nothing
        like = [j for j in range(len(shapes)) if j != i and j not in outliers and lead_of[j] == lead_of[i]]
        if like and np.all(flat[like].min(0) <= flat[i]) and np.all(flat[i] <= flat[like].max(0)):
            continue
        budget -= counts[i]
        outliers[i] = f"rare: beyond coverage={coverage:g}"
    return outliers


def _cuts(traffic: Traffic, counts: np.ndarray, costs: np.ndarray, kept: list[int], k: int | None,
          act: Callable[[Shape], float | None], max_activation_mib: float | None) -> dict[int, tuple[list, tuple]]:
    """{number of boxes: (the boxes, (how far from allowed, objective))} of the greedy axis-aligned cuts of ``kept``,
    one box more at each step."""
    shapes = traffic.shapes
    dims = [(n, d) for n in traffic.names for d in range(len(shapes[kept[0]][n]))]

    def excess(idx: list[int]) -> float:
        """How far a box is from allowed (0: allowed): its max may hold at most MAX_SLACK x the input elements of its
        largest request (a batch of 16 thumbnails and one full page make a box of 16 full pages) and stay within the
        activation budget. Log ratios, so that cuts that move a box towards allowed count."""
        top = {n: tuple(r["max"]) for n, r in _box(shapes, idx, idx[0]).items()}
        over = max(0.0, math.log(_elements(top) / (MAX_SLACK * max(_elements(shapes[i]) for i in idx))))
        v = act(top)
        return over + (max(0.0, math.log(v / max_activation_mib)) if v is not None else 0.0)

    def score(groups: list[list[int]]) -> tuple[float, float]:  # (how far from allowed, objective)
        return (round(sum(excess(g) for g in groups), 9),
                sum(_group_cost(g, costs, counts) for g in groups) / counts[kept].sum())

    # greedy axis-aligned splits: the boxes stay disjoint, so each request is served by its own group's profile
    kmax = k or MAX_PROFILES
    groups = [kept]
    steps = {1: (list(groups), score(groups))}
    while len(groups) < min(kmax, len(kept)) or (k is None and steps[len(groups)][1][0] and len(groups) < 2 * kmax
                                                  and len(groups) < len(kept)):  # more only while some box is not allowed
        best = None
        for gi, g in enumerate(groups):
            for n, d in dims:
                values = sorted({shapes[i][n][d] for i in g})
                for t in values[:-1]:
                    lo = [i for i in g if shapes[i][n][d] <= t]
                    hi = [i for i in g if shapes[i][n][d] > t]
                    cand = groups[:gi] + [lo, hi] + groups[gi + 1:]
                    sc = score(cand)
                    if best is None or sc < best[0]:
                        best = (sc, cand)
        if best is None:
            break
        groups = best[1]
        steps[len(groups)] = (list(groups), best[0])
    return steps


def _choose_k(steps: dict[int, tuple[list, tuple]], k: int | None,
              max_activation_mib: float | None) -> tuple[dict[int, float], int, str]:
    """(the objective of each allowed K, the K chosen, why): ``k`` when given, else the smallest K whose next profile
    improves the objective by less than K_GAIN."""
    objective = {kk: sc[1] for kk, (_, sc) in steps.items() if sc[0] == 0}
    if not objective:
        raise ConfigError(
            f"model.traffic: {max(steps)} profile(s) cannot cover the traffic: a profile's max would hold far more than "
            f"its largest request" + (f" or exceed max_activation_mib={max_activation_mib:g}" if max_activation_mib else ""),
            fix="raise model.traffic.profiles (or leave it out), raise model.traffic.max_activation_mib, or lower "
                "model.traffic.coverage to leave the odd requests out")
    if k is not None:
        if k not in objective:
            raise ConfigError(f"model.traffic.profiles={k}: {k} profile(s) cannot cover the traffic within the "
                              "activation bounds", fix=f"raise model.traffic.profiles (the first that can: {min(objective)})")
        chosen, reason = k, f"profiles={k} (model.traffic.profiles)"
    else:
        ks = sorted(objective)
        chosen = ks[0]
        for a, b in zip(ks, ks[1:]):
            gain = (objective[a] - objective[b]) / objective[a] if objective[a] > 0 else 0.0
            if gain < K_GAIN:
                break
            chosen = b
        nxt = chosen + 1 if chosen + 1 in objective else None
        reason = (f"{chosen} profile(s): mean |log(cost/opt cost)| {objective[chosen]:.3f}"
                  + (f"; a {nxt}th would cut it to {objective[nxt]:.3f} (less than {K_GAIN:.0%} better), "
                     "not worth another profile's build time and engine size" if nxt else "")
                  + (f"; fewer: " + ", ".join(f"{kk}: {objective[kk]:.3f}" for kk in ks if kk < chosen)
                     if chosen != ks[0] else "")
                  + (f"; {', '.join(str(kk) for kk in sorted(steps) if kk not in objective)} profile(s) cannot hold "
                     "the traffic within the activation bounds" if len(objective) < len(steps) else ""))
    return objective, chosen, reason


def check_given(traffic: Traffic, profiles: list[dict]) -> Proposal:
    """Coverage of profiles the user wrote (model.profiles wins over the proposal) on the traffic."""
    per, covered, out = [0] * len(profiles), 0, []
    for s, c in zip(traffic.shapes, traffic.counts):
        p = serving(profiles, s)
        if p is None:
            out.append({**{n: list(s[n]) for n in traffic.names}, "count": int(c), "why": "outside every profile"})
        else:
            per[p] += c
            covered += c
    return Proposal([{n: {w: list(r[w]) for w in ("min", "opt", "max")} for n, r in p.items()} for p in profiles],
                    traffic.requests, covered, per, sorted(out, key=lambda o: -o["count"]), {}, len(profiles),
                    "model.profiles given (checked against the traffic)", "-")

