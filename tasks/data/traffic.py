"""Shape profiles from real traffic: the shapes a service sees decide min/opt/max.

A traffic record is a JSON Lines file, one observed request per line mapping each dynamic input to its shape with an
optional ``count`` (``{"x": [1, 3, 736, 1312], "count": 42}``), or a folder of ``.npz``/``.npy`` requests (one per
file; only the array headers are read). Shapes are what the model is fed (after the service's own resizing).

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

import json
import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tasks.common.errors import ConfigError
from tasks.graph.flops import inferred_at, onnx_flops
from tasks.graph.models import TensorInfo

KEY = "model.traffic.source"
EXACT_COSTS = 24  # exact FLOP estimates (one ONNX shape inference each); more unique shapes are interpolated
MAX_PROFILES = 4
K_GAIN = 0.25  # a further profile must cut the objective by at least this share
MAX_SLACK = 1.5  # a profile's max holds at most this many times the input elements of its largest request
Shape = dict[str, tuple[int, ...]]


@dataclass
class Traffic:
    """Unique request shapes with their counts (over the inputs the record names)."""
    source: str
    names: list[str]
    shapes: list[Shape]
    counts: list[int]

    @property
    def requests(self) -> int:
        return int(sum(self.counts))

    def digest(self) -> str:
        from tasks.common.util import sha256_json

        return sha256_json([[{n: list(s[n]) for n in self.names}, c] for s, c in zip(self.shapes, self.counts)])


# -- reading -----------------------------------------------------------------------------------------------------------

def _npy_shape(f) -> tuple[int, ...]:
    version = np.lib.format.read_magic(f)
    header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    return tuple(int(d) for d in header(f)[0])


def _file_requests(path: Path, dynamic: list[str]) -> list[dict]:
    try:
        if path.suffix == ".npy":
            if len(dynamic) != 1:
                raise ConfigError(f"{KEY}: {path.name} is a .npy (one array) but the model has {len(dynamic)} dynamic "
                                  f"inputs ({', '.join(dynamic)})", fix="save each request as .npz, one array per input name")
            with open(path, "rb") as f:
                return [{dynamic[0]: list(_npy_shape(f))}]
        with zipfile.ZipFile(path) as z:
            req = {}
            for member in z.namelist():
                if member.endswith(".npy"):
                    with z.open(member) as f:
                        req[member[:-4]] = list(_npy_shape(f))
            return [req]
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ConfigError(f"{KEY}: {path} cannot be read as a request array ({type(e).__name__}: {e})",
                          fix="one request per .npz (an array per input name) or .npy file") from None


def traffic_path(source: str, search: list[Path] | None = None) -> Path:
    """The traffic record: a file or folder, relative to the working directory or the config dir."""
    path = Path(str(source)).expanduser()
    for c in [path] if path.is_absolute() else [path] + [Path(d) / path for d in (search or [])]:
        if c.exists():
            return c.resolve()
    raise ConfigError(f"{KEY}={source!r}: no such file or folder",
                      fix="a .jsonl of request shapes or a folder of .npz/.npy requests (relative to the working "
                          "directory or the config dir)")


def traffic_hash(source: str, search: list[Path] | None = None) -> str:
    """What a build depends on in the record (content of the file, or names and contents of the folder's arrays)."""
    from tasks.common.util import sha256_file, sha256_json

    path = traffic_path(source, search)
    if path.is_file():
        return sha256_file(path)
    return sha256_json([(p.name, sha256_file(p)) for p in sorted(path.iterdir()) if p.suffix in (".npz", ".npy")])


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


def read_traffic(source: str | Path, inputs: list[TensorInfo]) -> Traffic:
    """The requests of ``source`` checked against the model's inputs: every dynamic input named, ranks and fixed dims
    as the model has them, positive dims, positive counts. ConfigError naming the line or file otherwise."""
    path = Path(source).expanduser()
    by_name = {i.name: i for i in inputs}
    dynamic = [i.name for i in inputs if not i.is_static()]
    if not dynamic:
        raise ConfigError(f"{KEY}={source}: the model's inputs are all static ({', '.join(by_name)}): there is no "
                          "shape to profile", fix="remove model.traffic")
    raw: list[tuple[str, dict, int]] = []  # (where, shapes, count)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".npz", ".npy"))
        raw = [(p.name, r, 1) for p in files for r in _file_requests(p, dynamic)]
    elif path.is_file():
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{KEY}={source} line {no} is not JSON ({e.msg})",
                                  fix='one request per line, e.g. {"x": [1, 3, 736, 1312], "count": 42}') from None
            if not isinstance(obj, dict):
                raise ConfigError(f"{KEY}={source} line {no} is not an object",
                                  fix='one request per line, e.g. {"x": [1, 3, 736, 1312], "count": 42}')
            count = obj.pop("count", 1)
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ConfigError(f"{KEY}={source} line {no}: count={count!r} is not a positive integer",
                                  fix="count is how many requests had this shape (1 or more); leave it out for 1")
            raw.append((f"line {no}", obj, count))
    else:
        raise ConfigError(f"{KEY}={source} does not exist", fix="a .jsonl file of request shapes or a folder of .npz/.npy")
    if not raw:
        raise ConfigError(f"{KEY}={source} holds no request", fix='one request per line, e.g. {"x": [1, 3, 736, 1312]}')
    merged: dict[tuple, int] = {}
    for where, req, count in raw:
        unknown = [n for n in req if n not in by_name]
        if unknown:
            raise ConfigError(f"{KEY}={source} {where}: the model has no input {unknown[0]!r}",
                              fix=f"name the model's inputs: {', '.join(by_name)}")
        missing = [n for n in dynamic if n not in req]
        if missing:
            raise ConfigError(f"{KEY}={source} {where}: no shape for the dynamic input {missing[0]!r}",
                              fix=f"give every dynamic input's shape: {', '.join(dynamic)}")
        key = []
        for n in dynamic:
            dims, model = req[n], by_name[n].shape
            if not isinstance(dims, list) or len(dims) != len(model):
                raise ConfigError(f"{KEY}={source} {where}: {n}={dims!r} has rank {len(dims) if isinstance(dims, list) else '?'}, "
                                  f"the model's {n} is {model} (rank {len(model)})", fix=f"record {n}'s full shape")
            for i, (d, m) in enumerate(zip(dims, model)):
                if not isinstance(d, int) or isinstance(d, bool) or d < 1:
                    raise ConfigError(f"{KEY}={source} {where}: {n}={dims} has dim {i} = {d!r}",
                                      fix="dims are positive integers: the shape the model was fed")
                if isinstance(m, int) and m > 0 and d != m:
                    raise ConfigError(f"{KEY}={source} {where}: {n}={dims} has dim {i} = {d}, the model fixes it at {m}",
                                      fix=f"record the shapes the model is fed ({n} is {model})")
            key.append((n, tuple(dims)))
        merged[tuple(key)] = merged.get(tuple(key), 0) + count
    return Traffic(str(source), dynamic, [dict(k) for k in merged], list(merged.values()))


def check_rules(traffic: Traffic, rules) -> None:
    """Every request on its dims' multiples (model.shape_multiple) and equal where the model ties two dims."""
    for s in traffic.shapes:
        for n, dims in s.items():
            for i, d in enumerate(dims):
                step = rules.step(n, i)
                if step > 1 and d % step:
                    raise ConfigError(
                        f"{KEY}={traffic.source}: a request has {n}={list(dims)}, dim {i} = {d} is no multiple of "
                        f"{step} (model.shape_multiple.{n})",
                        fix="record the shapes the model is fed, after the service's resizing to its stride")
        for t in rules.ties:
            if not t.hard:
                continue
            (na, ia), (nb, ib) = t.a, t.b
            if na in s and nb in s and s[na][ia] != s[nb][ib]:
                raise ConfigError(f"{KEY}={traffic.source}: a request has {na}[{ia}]={s[na][ia]} and {nb}[{ib}]="
                                  f"{s[nb][ib]}, which the model ties ({t.why})", fix="record consistent shapes")


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


def inside(profile: dict, shape: Shape) -> bool:
    return all(all(lo <= d <= hi for d, lo, hi in zip(shape[n], r["min"], r["max"])) for n, r in profile.items()
               if n in shape)


def serving(profiles: list[dict], shape: Shape) -> int | None:
    """The profile the runtime picks for a request (the first that contains it), else None."""
    return next((k for k, p in enumerate(profiles) if inside(p, shape)), None)


def propose(traffic: Traffic, model=None, k: int | None = None, coverage: float = 0.999,
            max_activation_mib: float | None = None) -> Proposal:
    if not 0.0 < coverage <= 1.0:
        raise ConfigError(f"model.traffic.coverage={coverage} is outside (0, 1]", fix="e.g. 0.999")
    if k is not None and not 1 <= k <= 16:
        raise ConfigError(f"model.traffic.profiles={k} is outside 1..16", fix="e.g. 2, or leave it out to let trtforge choose")
    shapes, counts = traffic.shapes, np.array(traffic.counts, dtype=np.int64)
    costs_ = Costs(model, shapes)
    costs = np.maximum(costs_.values, 1e-9)
    outliers: dict[int, str] = {}
    # activation memory grows with the input elements (conv nets: linearly): estimated from one exact value at the
    # largest request, so the search can test every candidate group; the chosen profiles get exact values
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

    for i, s in enumerate(shapes):
        a = act(s)
        if a is not None and a > max_activation_mib:
            outliers[i] = f"needs ~{a:.0f} MiB of activations > max_activation_mib={max_activation_mib:g}"
    budget = int(math.floor((1.0 - coverage) * traffic.requests + 1e-9)) - int(counts[list(outliers)].sum())
    lead = varying_dims(traffic, top=None, order="input")[:1]  # the first dim that varies (batch, usually)
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
    kept = sorted((i for i in range(len(shapes)) if i not in outliers),
                  key=lambda i: (*(shapes[i][n][d] for n, d in lead), costs[i], _elements(shapes[i])))
    if not kept:
        raise ConfigError(f"model.traffic: no request is left to profile ({len(outliers)} outliers)",
                          fix="raise model.traffic.max_activation_mib or lower model.traffic.coverage")

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


# -- draws and the picture ---------------------------------------------------------------------------------------------

@dataclass
class TrafficDraws:
    """Draws request shapes from the traffic, weighted by count (the shape rules' hook: tasks.data.profiles)."""
    traffic: Traffic

    def draw(self, profile: dict, n: int, rng: np.random.Generator) -> list[dict[str, list[int]]] | None:
        idx = [i for i, s in enumerate(self.traffic.shapes) if inside(profile, s)]
        if not idx or n < 1:
            return None
        w = np.array([self.traffic.counts[i] for i in idx], dtype=float)
        picks = rng.choice(len(idx), size=n, p=w / w.sum())
        return [{name: list(self.traffic.shapes[idx[j]][name]) if name in self.traffic.shapes[idx[j]]
                 else list(r["opt"]) for name, r in profile.items()} for j in picks]

    def draw_single(self, profile: dict, n: int, rng: np.random.Generator) -> list[dict[str, list[int]]]:
        """n requests from the whole traffic (weighted), each as one sample: the batch dim (a leading dim that
        varies) at 1; inputs the traffic does not name at ``profile``'s opt. For calibration."""
        w = np.array(self.traffic.counts, dtype=float)
        batch = {n_ for n_, d in varying_dims(self.traffic, top=None, order="input") if d == 0}
        out = []
        for j in rng.choice(len(w), size=n, p=w / w.sum()):
            s = self.traffic.shapes[j]
            out.append({name: ([1] + list(s[name][1:]) if name in batch else list(s[name])) if name in s
                        else list(r["opt"]) for name, r in profile.items()})
        return out

    def as_dict(self) -> dict:
        return {"source": self.traffic.source, "digest": self.traffic.digest()}


def varying_dims(traffic: Traffic, top: int | None = 2, order: str = "spread") -> list[tuple[str, int]]:
    """The (input, axis) pairs whose values vary across requests: most varying first (log spread), or in input
    order (``order="input"``); at most ``top``."""
    spread = []
    for n in traffic.names:
        for d in range(len(traffic.shapes[0][n])):
            vals = [s[n][d] for s in traffic.shapes]
            if max(vals) != min(vals):
                spread.append((math.log(max(vals) / min(vals)), (n, d)))
    if order == "spread":
        spread.sort(key=lambda t: -t[0])
    return [d for _, d in spread][:top]


def plot(traffic: Traffic, proposal: Proposal, path: Path) -> Path | None:
    """The requests (area ~ count) over the two dims that vary most after the leading one (the batch, usually), one
    panel per value of the leading dim, with each profile's box and opt (x); outliers in red."""
    lead = varying_dims(traffic, top=None, order="input")[:1]
    rest = [d for d in varying_dims(traffic, top=None) if d not in lead]
    if len(rest) < 2 and lead:  # too few other dims: the leading one is an axis too
        rest, lead = (rest + lead)[:2], []
    if not rest:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    colors = ["#1565c0", "#2e7d32", "#ef6c00", "#6a1b9a", "#00838f", "#ad1457"]
    (nx, dx), (ny, dy) = rest[0], (rest[1] if len(rest) > 1 else (None, None))
    leads = sorted({tuple(s[n][d] for n, d in lead) for s in traffic.shapes})[:6]
    fig, axes = plt.subplots(1, len(leads), figsize=(4.2 * len(leads) + 1, 4.6), squeeze=False, sharey=True)
    cmax = max(traffic.counts)
    which = [serving(proposal.profiles, s) for s in traffic.shapes]
    for ax, lv in zip(axes[0], leads):
        idx = [i for i, s in enumerate(traffic.shapes) if tuple(s[n][d] for n, d in lead) == lv]
        ys = [traffic.shapes[i][ny][dy] if ny else 0 for i in idx]
        ax.scatter([traffic.shapes[i][nx][dx] for i in idx], ys,
                   s=[10 + 300 * traffic.counts[i] / cmax for i in idx], alpha=0.55, edgecolors="none",
                   c=[colors[which[i] % len(colors)] if which[i] is not None else "#c62828" for i in idx])
        for k, p in enumerate(proposal.profiles):
            if lead and not all(p[n]["min"][d] <= v <= p[n]["max"][d] for (n, d), v in zip(lead, lv)):
                continue
            col = colors[k % len(colors)]
            x0, x1 = p[nx]["min"][dx], p[nx]["max"][dx]
            y0, y1 = (p[ny]["min"][dy], p[ny]["max"][dy]) if ny else (-0.5, 0.5)
            ax.add_patch(Rectangle((x0, y0), max(x1 - x0, 1), max(y1 - y0, 1), fill=False, lw=1.8, ec=col,
                                   label=f"profile {k}: {proposal.per_profile[k]} requests"))
            ax.plot([p[nx]["opt"][dx]], [p[ny]["opt"][dy] if ny else 0], marker="x", ms=11, mew=2.5, color=col)
        ax.set_title(", ".join(f"{n}[{d}] = {v}" for (n, d), v in zip(lead, lv)) or "requests", fontsize=9)
        ax.set_xlabel(f"{nx}[{dx}]")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower left")
    axes[0][0].set_ylabel(f"{ny}[{dy}]" if ny else "")
    n_out = sum(o["count"] for o in proposal.outliers)
    fig.suptitle(f"traffic: {proposal.requests} requests (area ~ count), {proposal.coverage:.2%} covered by "
                 f"{len(proposal.profiles)} profile(s), x = opt" + (f"; {n_out} outliers in red" if n_out else ""),
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def describe(p: Proposal) -> str:
    """The proposal as text: profiles with their coverage, the outliers, the objective per K and why this K."""
    lines = [f"{p.requests} requests; {p.covered} covered ({p.coverage:.3%}) by {len(p.profiles)} profile(s); cost: "
             f"{p.cost_how}"]
    for k, prof in enumerate(p.profiles):
        act = p.activation_mib[k] if k < len(p.activation_mib) else None
        lines.append(f"  profile {k}: {p.per_profile[k]} requests"
                     + (f", ~{act:.0f} MiB activations at max" if act is not None else ""))
        for n, r in prof.items():
            lines.append(f"    {n}: min {r['min']} opt {r['opt']} max {r['max']}")
    if p.outliers:
        lines.append(f"  outliers ({sum(o['count'] for o in p.outliers)} requests, left out):")
        for o in p.outliers[:10]:
            lines.append("    " + ", ".join(f"{k}={v}" for k, v in o.items()))
        if len(p.outliers) > 10:
            lines.append(f"    ... and {len(p.outliers) - 10} more")
    if p.objective:
        lines.append("  objective (mean |log(cost / opt cost)|) by number of profiles: "
                     + ", ".join(f"{k}: {v:.3f}" for k, v in p.objective.items()))
    if p.opt_distance is not None:
        lines.append(f"  mean distance of a request to its profile's opt: {p.opt_distance:.1%} of the opt's cost")
    lines.append(f"  why: {p.k_reason}")
    return "\n".join(lines)


def yaml_fragment(profiles: list[dict]) -> str:
    """``profiles:`` in the model YAML's style, one flow mapping per input."""
    out = ["profiles:"]
    for p in profiles:
        first = True
        for n, r in p.items():
            out.append(f"  {'- ' if first else '  '}{n}: {{min: {r['min']}, opt: {r['opt']}, max: {r['max']}}}")
            first = False
    return "\n".join(out) + "\n"


def write_profiles(model_yaml: Path, profiles: list[dict]) -> None:
    """Replace (or add) the top-level ``profiles:`` block of a model YAML, keeping every other line as it is."""
    lines = model_yaml.read_text().splitlines()
    out, skip = [], False
    for line in lines:
        if line.startswith("profiles:"):
            skip = True
            continue
        if skip and (line.startswith((" ", "-", "\t")) or not line.strip()):
            continue
        skip = False
        out.append(line)
    text = "\n".join(out).rstrip("\n") + "\n" + yaml_fragment(profiles)
    model_yaml.write_text(text)

