"""Optimization profiles (min/opt/max per input): checks against the model, and shapes inside them."""
from __future__ import annotations

import difflib
from typing import Any
from dataclasses import dataclass, field

import numpy as np

from tasks.common.errors import ConfigError
from tasks.graph.models import TensorInfo

Profile = dict  # input name -> {"min": [...], "opt": [...], "max": [...]}


def _close(name: str, names: list[str]) -> str:
    m = difflib.get_close_matches(name, names, n=1)
    return f" (did you mean {m[0]!r}?)" if m else ""


def check_profiles(profiles: list[Profile], inputs: list[TensorInfo], key: str = "model.profiles") -> list[Profile]:
    """Validate profiles against the model's inputs; return complete profiles (static inputs filled in)."""
    by_name = {t.name: t for t in inputs}
    names = list(by_name)
    dynamic = [t for t in inputs if not t.is_static()]
    if not profiles:
        if dynamic:
            t = dynamic[0]
            raise ConfigError(
                f"{key} is empty but input {t.name!r} has dynamic shape {t.shape}",
                fix=f"add a profile, e.g. {key}=[{{{t.name}: {{min: [...], opt: [...], max: [...]}}}}]")
        profiles = [{}]
    full = []
    for p_i, prof in enumerate(profiles):
        k = f"{key}[{p_i}]"
        out = {}
        for name, rng in prof.items():
            if name not in by_name:
                raise ConfigError(f"{k}: the model has no input {name!r}{_close(name, names)}",
                                  fix=f"use one of the model's inputs: {', '.join(names)}")
            t = by_name[name]
            dims = {}
            for which in ("min", "opt", "max"):
                v = rng.get(which) if hasattr(rng, "get") else None
                if v is None:
                    raise ConfigError(f"{k}.{name}.{which} is missing", fix=f"give min, opt and max, each of rank {t.rank}")
                v = [int(x) for x in v]
                if len(v) != t.rank:
                    raise ConfigError(f"{k}.{name}.{which}={v} has rank {len(v)} but input {name!r} has rank {t.rank} {t.shape}",
                                      fix=f"give {t.rank} dims")
                if any(x <= 0 for x in v):
                    raise ConfigError(f"{k}.{name}.{which}={v} has a dim <= 0", fix="dims must be positive")
                dims[which] = v
            for i, (lo, mid, hi) in enumerate(zip(dims["min"], dims["opt"], dims["max"])):
                if not lo <= mid <= hi:
                    raise ConfigError(
                        f"{k}.{name}: dim {i} has min={lo} opt={mid} max={hi}, which is not min <= opt <= max",
                        fix=f"reorder so that min <= opt <= max (min={dims['min']} opt={dims['opt']} max={dims['max']})")
                static = t.shape[i]
                if isinstance(static, int) and not (lo == mid == hi == static):
                    raise ConfigError(
                        f"{k}.{name}: dim {i} is fixed to {static} in the model but the profile gives {lo}/{mid}/{hi}",
                        fix=f"use {static} for dim {i} in min, opt and max")
            out[name] = dims
        for t in inputs:
            if t.name in out:
                continue
            if not t.is_static():
                raise ConfigError(f"{k} has no entry for dynamic input {t.name!r} {t.shape}",
                                  fix=f"add {t.name}: {{min: [...], opt: [...], max: [...]}} to the profile")
            out[t.name] = {"min": list(t.shape), "opt": list(t.shape), "max": list(t.shape)}
        full.append(out)
    return full


# --- dims that must agree, and the step each dim is drawn on -------------------------------------------------

Dim = tuple  # (input name, axis)
UNNAMED = ("?", "")
# ops whose inputs broadcast against each other: equal symbolic dims (or a 1) are required
BROADCAST_OPS = {"Add", "Sub", "Mul", "Div", "Pow", "Mod", "Where", "Equal", "Greater", "GreaterOrEqual", "Less",
                 "LessOrEqual", "And", "Or", "Xor", "Max", "Min", "Sum", "Mean", "PRelu", "BitShift"}
MAX_INFERRED_MULTIPLE = 64


@dataclass
class DimTie:
    """Two input dims that must take the same value, and why (shown in errors)."""

    a: Dim
    b: Dim
    why: str
    kind: str = "name"  # "name" (a shared dim name), "graph" (an op combines them), "profile" (same ranges: a guess)

    @property
    def hard(self) -> bool:
        """From the model: a profile that contradicts it is refused."""
        return self.kind != "profile"


@dataclass
class ShapeRules:
    """How shapes are drawn inside the profiles: one value per group of tied dims, each a multiple of its step.

    `multiples` are per input, per dim (model.shape_multiple, or inferred from the profiles: `inferred` lists those)."""

    ties: list[DimTie] = field(default_factory=list)
    multiples: dict[str, list[int]] = field(default_factory=dict)
    inferred: dict[str, list[int]] = field(default_factory=dict)
    traffic: Any = None  # tasks.data.traffic.TrafficDraws: random shapes are drawn from the traffic's mix, weighted
    domains: dict = field(default_factory=dict)  # {input: tasks.graph.meaning.Domain}: what random values mean

    def __post_init__(self) -> None:
        self._parent: dict[Dim, Dim] = {}
        for t in self.ties:
            ra, rb = self.group(t.a), self.group(t.b)
            if ra != rb:
                self._parent[max(ra, rb)] = min(ra, rb)

    def group(self, d: Dim) -> Dim:
        while d in self._parent:
            d = self._parent[d]
        return d

    def step(self, name: str, axis: int) -> int:
        m = self.multiples.get(name) or []
        return int(m[axis]) if axis < len(m) else 1

    def group_steps(self, profile: Profile) -> dict[Dim, int]:
        """The step of each group of varying dims: the largest of its members' (steps are powers of two or equal)."""
        out: dict[Dim, int] = {}
        for n, r in profile.items():
            for i, (lo, hi) in enumerate(zip(r["min"], r["max"])):
                if lo != hi:
                    g = self.group((n, i))
                    out[g] = max(out.get(g, 1), self.step(n, i))
        return out

    def as_dict(self) -> dict:
        return {"ties": [{"a": list(t.a), "b": list(t.b), "why": t.why, "kind": t.kind} for t in self.ties],
                "multiples": self.multiples, "inferred_multiples": self.inferred,
                **({"traffic": self.traffic.as_dict()} if self.traffic is not None else {}),
                **({"domains": {n: d.as_dict() for n, d in sorted(self.domains.items())}} if self.domains else {})}


def named_ties(inputs: list[TensorInfo]) -> list[DimTie]:
    """Dims of different inputs that carry the same symbolic name (TensorRT reads them as one dim)."""
    first: dict[str, Dim] = {}
    ties = []
    for t in inputs:
        for i, d in enumerate(t.shape):
            if isinstance(d, str) and d not in UNNAMED:
                if d in first and first[d][0] != t.name:  # inside one input, export gives repeats distinct names
                    ties.append(DimTie(first[d], (t.name, i), f"both are the model's dim {d!r}"))
                else:
                    first.setdefault(d, (t.name, i))
    return ties


def graph_ties(model, inputs: list[TensorInfo]) -> list[DimTie]:
    """Dims of different inputs that the graph forces equal: each dynamic input dim gets its own symbol, ONNX shape
    inference carries the symbols through the graph, and an elementwise op (or a MatMul's inner dims) meeting two
    different input symbols ties them."""
    import onnx

    dynamic = [t for t in inputs if not t.is_static()]
    if len(dynamic) < 2:
        return []
    prefix = "__trtforge__"
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.value_info[:]
    owner: dict[str, Dim] = {}
    names = {t.name for t in dynamic}
    for vi in m.graph.input:
        if vi.name in names:
            for i, d in enumerate(vi.type.tensor_type.shape.dim):
                if not (d.HasField("dim_value") and d.dim_value > 0):
                    sym = f"{prefix}{len(owner)}"
                    d.Clear()
                    d.dim_param = sym
                    owner[sym] = (vi.name, i)
    try:
        m = onnx.shape_inference.infer_shapes(m, data_prop=True)
    except Exception:  # a model ONNX cannot infer: the names (and the profiles) are all we know
        return []
    shapes = {vi.name: [d.dim_param if d.dim_param.startswith(prefix) else None for d in vi.type.tensor_type.shape.dim]
              for vi in list(m.graph.input) + list(m.graph.value_info) + list(m.graph.output)
              if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")}
    ties: list[DimTie] = []
    seen: set = set()

    def tie(x: str | None, y: str | None, node) -> None:
        if x and y and x != y and (x, y) not in seen:
            seen.update({(x, y), (y, x)})
            ties.append(DimTie(owner[x], owner[y], f"node {node.name or node.op_type!r} ({node.op_type}) combines them", "graph"))

    for node in m.graph.node:
        ins = [shapes.get(x) for x in node.input if x]
        if node.op_type in BROADCAST_OPS:
            known = [s for s in ins if s]
            for s1, s2 in zip(known, known[1:]):
                for x, y in zip(reversed(s1), reversed(s2)):
                    tie(x, y, node)
        elif node.op_type == "MatMul" and len(ins) == 2 and ins[0] and ins[1] and len(ins[0]) >= 2 and len(ins[1]) >= 2:
            tie(ins[0][-1], ins[1][-2], node)
            for x, y in zip(reversed(ins[0][:-2]), reversed(ins[1][:-2])):
                tie(x, y, node)
    return ties


def profile_ties(profiles: list[Profile], inputs: list[TensorInfo]) -> list[DimTie]:
    """Varying dims of different inputs with the same min/opt/max in every profile (input_ids and attention_mask
    exported with separate names): drawn as one, a guess that keeps related inputs in step and never refuses."""
    first: dict[tuple, Dim] = {}
    ties = []
    for t in inputs:
        for i in range(t.rank):
            ranges = tuple(tuple(p[t.name][w][i] for w in ("min", "opt", "max")) for p in profiles if t.name in p)
            if not ranges or all(r[0] == r[2] for r in ranges):
                continue
            if ranges in first and first[ranges][0] != t.name:
                ties.append(DimTie(first[ranges], (t.name, i), "same min/opt/max in every profile", "profile"))
            else:
                first.setdefault(ranges, (t.name, i))
    return ties


def check_ties(profiles: list[Profile], ties: list[DimTie], key: str = "model.profiles") -> None:
    """Refuse profiles that give tied dims different ranges (TensorRT would refuse them at build time, ONNX Runtime
    at run time). A dim fixed at 1 may broadcast against the other when the tie comes from an elementwise op."""
    for p_i, prof in enumerate(profiles):
        for t in ties:
            (na, ia), (nb, ib) = t.a, t.b
            if not t.hard or na not in prof or nb not in prof:
                continue
            ra = [prof[na][w][ia] for w in ("min", "opt", "max")]
            rb = [prof[nb][w][ib] for w in ("min", "opt", "max")]
            if ra == rb or (t.kind == "graph" and (ra == [1, 1, 1] or rb == [1, 1, 1])):
                continue
            fixed = {w: [ra[j] if d == ib else v for d, v in enumerate(prof[nb][w])] for j, w in enumerate(("min", "opt", "max"))}
            raise ConfigError(
                f"{key}[{p_i}]: input {na!r} dim {ia} is {ra[0]}/{ra[1]}/{ra[2]} (min/opt/max) but input {nb!r} dim {ib} "
                f"is {rb[0]}/{rb[1]}/{rb[2]}; the model needs them equal ({t.why})",
                fix=f"give {nb!r} dim {ib} the same range as {na!r}: {key}[{p_i}].{nb}="
                    f"{{min: {fixed['min']}, opt: {fixed['opt']}, max: {fixed['max']}}}")


def infer_multiples(profiles: list[Profile], given: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """Per input without a model.shape_multiple: per varying dim, the largest power of two (at most 64) dividing its
    min, opt and max in every profile. A stride-32 detector profiled 320..640 is drawn on 64s, never at 524."""
    given = given or {}
    out: dict[str, list[int]] = {}
    names = [n for p in profiles for n in p]
    for n in dict.fromkeys(names):
        if n in given:
            continue
        rank = len(next(p[n]["min"] for p in profiles if n in p))
        steps = []
        for i in range(rank):
            vals = [p[n][w][i] for p in profiles if n in p for w in ("min", "opt", "max")]
            step = 1
            if min(vals) != max(vals):
                while step < MAX_INFERRED_MULTIPLE and all(v % (step * 2) == 0 for v in vals):
                    step *= 2
            steps.append(step)
        if any(s > 1 for s in steps):
            out[n] = steps
    return out


def check_multiples(multiples: dict, inputs: list[TensorInfo], key: str = "model.shape_multiple") -> dict[str, list[int]]:
    by_name = {t.name: t for t in inputs}
    out = {}
    for n, v in multiples.items():
        if n not in by_name:
            raise ConfigError(f"{key}: the model has no input {n!r}{_close(n, list(by_name))}",
                              fix=f"use one of the model's inputs: {', '.join(by_name)}")
        v = [int(x) for x in v]
        if len(v) != by_name[n].rank or any(x < 1 for x in v):
            raise ConfigError(f"{key}.{n}={v} needs {by_name[n].rank} positive dims (input {n!r} is {by_name[n].shape})",
                              fix=f"one multiple per dim, 1 where any size is fine, e.g. {[1] * by_name[n].rank}")
        out[n] = v
    return out


def shape_rules(inputs: list[TensorInfo], profiles: list[Profile], model=None,
                multiples: dict[str, list[int]] | None = None, key: str = "model.profiles") -> ShapeRules:
    """Ties from the model (names; the graph when given) checked against the profiles, ties the profiles suggest,
    and each dim's step (model.shape_multiple, else inferred from the profiles)."""
    hard = named_ties(inputs) + (graph_ties(model, inputs) if model is not None else [])
    check_ties(profiles, hard, key)
    given = check_multiples(multiples or {}, inputs)
    inferred = infer_multiples(profiles, given)
    domains = {}
    if model is not None:  # what the graph shows the inputs mean (ids, masks, lengths, positive values)
        from tasks.graph.meaning import input_domains
        domains = input_domains(model, [t.name for t in inputs])
    return ShapeRules(hard + profile_ties(profiles, inputs), {**given, **inferred}, inferred, domains=domains)


def _draw(lo: int, hi: int, step: int, rng: np.random.Generator) -> int:
    first, last = -(-lo // step), hi // step  # multiples of step inside [lo, hi]
    if step > 1 and first <= last:
        return int(rng.integers(first, last + 1)) * step
    return int(rng.integers(lo, hi + 1))


def shapes_in_profile(profile: Profile, n_random: int, rng: np.random.Generator,
                      rules: ShapeRules | None = None) -> list[dict[str, list[int]]]:
    """min, opt, max (without repeats: a static profile has one), then n_random random shapes in between, each kept
    even where it repeats a shape (a new draw of content): one value per group of tied dims, on each group's step."""
    rules = rules or ShapeRules()
    drawn_from_traffic = rules.traffic.draw(profile, n_random, rng) if rules.traffic is not None else None
    if drawn_from_traffic is not None:  # the opt shape, then requests as they arrive (weighted by their count)
        return [{n: list(r["opt"]) for n, r in profile.items()}] + drawn_from_traffic
    steps = rules.group_steps(profile)
    shapes = [{n: list(r[w]) for n, r in profile.items()} for w in ("min", "opt", "max")]
    for _ in range(n_random):
        drawn: dict[Dim, int] = {}
        shape = {}
        for n, r in profile.items():
            dims = []
            for i, (lo, hi) in enumerate(zip(r["min"], r["max"])):
                if lo == hi:
                    dims.append(lo)
                    continue
                g = rules.group((n, i))
                if g not in drawn:
                    drawn[g] = _draw(lo, hi, steps[g], rng)
                dims.append(min(max(drawn[g], lo), hi))
            shape[n] = dims
        shapes.append(shape)
    seen, uniq = set(), []
    for s in shapes[:3]:  # min, opt, max without duplicates (static profiles), order kept
        key = tuple((n, tuple(v)) for n, v in sorted(s.items()))
        if key not in seen:
            seen.add(key)
            uniq.append(s)
    return uniq + shapes[3:]
