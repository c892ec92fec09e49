"""Optimization profiles (min/opt/max per input): checks against the model, and shapes inside them."""
from __future__ import annotations

import difflib

import numpy as np

from .errors import ConfigError
from .models import TensorInfo

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


def shapes_in_profile(profile: Profile, n_random: int, rng: np.random.Generator,
                      dim_names: dict[str, list] | None = None,
                      multiples: dict[str, list[int]] | None = None) -> list[dict[str, list[int]]]:
    """min, opt, max, then random shapes in between.

    Dims that share a symbolic name across inputs (batch, sequence) get the same random value, so the
    drawn shapes stay consistent for models that require it.
    """
    shapes = [{n: list(r[w]) for n, r in profile.items()} for w in ("min", "opt", "max")]
    for _ in range(n_random):
        drawn: dict = {}
        shape = {}
        for n, r in profile.items():
            names = (dim_names or {}).get(n) or [None] * len(r["min"])
            dims = []
            for i, (lo, hi) in enumerate(zip(r["min"], r["max"])):
                sym = names[i] if i < len(names) and isinstance(names[i], str) and names[i] not in ("?", "") else None
                key = (sym, lo, hi) if sym else (n, i)
                if key not in drawn:
                    step = int(((multiples or {}).get(n) or [1] * len(r["min"]))[i])
                    first, last = -(-lo // step), hi // step  # multiples of step inside [lo, hi]
                    drawn[key] = int(rng.integers(first, last + 1)) * step if step > 1 and first <= last else int(rng.integers(lo, hi + 1))
                dims.append(drawn[key])
            shape[n] = dims
        shapes.append(shape)
    seen, uniq = set(), []
    for s in shapes:  # drop duplicates (static profiles), keep order
        key = tuple((n, tuple(v)) for n, v in sorted(s.items()))
        if key not in seen:
            seen.add(key)
            uniq.append(s)
    return uniq
