"""Model inputs for calibration and validation: user arrays, images, or random values inside the profiles."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigError
from .models import TensorInfo
from .profiles import shapes_in_profile
from .samples import images_batch
from .util import sha256_file

Feed = dict[str, np.ndarray]
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64, "int64": np.int64,
             "int32": np.int32, "int8": np.int8, "uint8": np.uint8, "bool": np.bool_}


def data_files(path: str, key: str) -> list[Path]:
    p = Path(path).expanduser()
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix in (".npz", ".npy"))
    else:
        raise ConfigError(f"{key}={path!r}: no such file or folder", fix="give a .npz/.npy file or a folder of them")
    bad = [f for f in files if f.suffix not in (".npz", ".npy")]
    if bad:
        raise ConfigError(f"{key}={path!r}: {bad[0].name} is not .npz or .npy", fix="save arrays with numpy.savez")
    if not files:
        raise ConfigError(f"{key}={path!r} holds no .npz/.npy files", fix="add arrays, one per model input name")
    return files


def data_hash(path: str, key: str) -> str:
    import hashlib

    h = hashlib.sha256()
    for f in data_files(path, key):
        h.update(f.name.encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def load_feeds(path: str, inputs: list[TensorInfo], profiles: list[dict], key: str, limit: int | None = None) -> list[Feed]:
    """Each file is one feed; a file whose arrays have one extra leading axis holds several samples."""
    names = [t.name for t in inputs]
    feeds: list[Feed] = []
    for f in data_files(path, key):
        try:
            if f.suffix == ".npy":
                if len(names) != 1:
                    raise ConfigError(f"{key}: {f.name} is a single .npy but the model has inputs {names}",
                                      fix="use .npz files with one array per input name")
                arrays = {names[0]: np.load(f, allow_pickle=False)}
            else:
                with np.load(f, allow_pickle=False) as z:
                    arrays = {k: z[k] for k in z.files}
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(f"{key}: {f} cannot be read ({type(e).__name__}: {e})", file=str(f), fix="re-save it with numpy.savez") from None
        extra = sorted(set(arrays) - set(names))
        missing = sorted(set(names) - set(arrays))
        if extra or missing:
            raise ConfigError(f"{key}: {f.name} has arrays {sorted(arrays)} but the model's inputs are {names}",
                              file=str(f), fix="name one array per model input" + (f"; missing {missing}" if missing else ""))
        ranks = {t.name: t.rank for t in inputs}
        stacked = all(arrays[n].ndim == ranks[n] + 1 for n in names)
        count = len(arrays[names[0]]) if stacked else 1
        for i in range(count):
            feeds.append({n: arrays[n][i] if stacked else arrays[n] for n in names})
            if limit and len(feeds) >= limit:
                break
        if limit and len(feeds) >= limit:
            break
    if not feeds:
        raise ConfigError(f"{key}={path!r} holds no samples", fix="add at least one sample")
    for i, feed in enumerate(feeds):
        check_feed(feed, inputs, profiles, f"{key} sample {i}")
    return feeds


def check_feed(feed: Feed, inputs: list[TensorInfo], profiles: list[dict], what: str) -> None:
    for t in inputs:
        a = feed[t.name]
        want = NP_DTYPES.get(t.dtype)
        if want is not None and a.dtype != want:
            raise ConfigError(f"{what}: input {t.name!r} has dtype {a.dtype}, the model expects {t.dtype}",
                              fix=f"convert with .astype(numpy.{np.dtype(want).name})")
        if a.ndim != t.rank:
            raise ConfigError(f"{what}: input {t.name!r} has shape {list(a.shape)} (rank {a.ndim}), the model expects rank {t.rank} {t.shape}",
                              fix="reshape the array")
        if a.size == 0:
            raise ConfigError(f"{what}: input {t.name!r} is empty {list(a.shape)}", fix="give non-empty arrays")
        if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all():
            raise ConfigError(f"{what}: input {t.name!r} has NaN or Inf values", fix="clean the data")
    ok = any(all(all(lo <= d <= hi for d, lo, hi in zip(feed[n].shape, r["min"], r["max"])) for n, r in p.items())
             for p in profiles)
    if not ok:
        shapes = {n: list(a.shape) for n, a in feed.items()}
        ranges = [{n: f"{r['min']}..{r['max']}" for n, r in p.items()} for p in profiles]
        raise ConfigError(f"{what}: shapes {shapes} fall outside every profile {ranges}",
                          fix="resize the data or widen model.profiles")


def random_value(t: TensorInfo, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    dt = NP_DTYPES.get(t.dtype, np.float32)
    if np.issubdtype(dt, np.floating):
        return rng.standard_normal(shape).astype(dt)
    if dt == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    return rng.integers(0, 2, shape).astype(dt)


def generated_feeds(inputs: list[TensorInfo], profiles: list[dict], n_random: int, seed: int,
                    recipe: Any | None = None, offset: int = 0, multiples: dict | None = None) -> list[Feed]:
    """Feeds at min, opt, max (and random shapes between) of each profile: images where a recipe says so, else noise."""
    rng = np.random.default_rng(seed)
    dim_names = {t.name: t.shape for t in inputs}
    by_name = {t.name: t for t in inputs}
    feeds = []
    for prof in profiles:
        for shape in shapes_in_profile(prof, n_random, rng, dim_names, multiples):
            feed = {}
            for name, s in shape.items():
                if recipe is not None and name == recipe["input"]:
                    feed[name] = images_batch(recipe, s, rng, start=offset + len(feeds))
                else:
                    feed[name] = random_value(by_name[name], s, rng)
            feeds.append(feed)
    return feeds


def calibration_shapes(profile: dict, n: int, rng: np.random.Generator, multiples: dict | None = None,
                       spread: tuple[float, float] = (0.6, 1.3)) -> list[dict]:
    """n single-sample shapes around the opt shape (batch 1; other dims scaled by a random factor, kept inside the
    profile and on the model's multiples): calibration sees content at several scales without max-size cost."""
    shapes = []
    for i in range(n):
        f = 1.0 if i == 0 else float(rng.uniform(*spread))
        shape = {}
        for name, r in profile.items():
            dims = []
            for d, (lo, opt, hi) in enumerate(zip(r["min"], r["opt"], r["max"])):
                if d == 0 and lo <= 1:
                    dims.append(1)
                    continue
                step = int(((multiples or {}).get(name) or [1] * len(r["opt"]))[d])
                v = int(round(opt * f / step)) * step if lo != hi else opt
                dims.append(int(min(max(v, lo), hi)))
            shape[name] = {"min": dims, "opt": dims, "max": dims}
        shapes.append(shape)
    return shapes


def heldout_shapes(profile: dict, n_random: int, rng: np.random.Generator, multiples: dict | None = None) -> list[dict]:
    """Shapes like validation draws them (min, opt, random in between: every aspect ratio), with batch 1 and at most
    the opt shape's size, so that an accuracy search judged on them agrees with validate at a fraction of the cost."""
    from .profiles import shapes_in_profile

    out = []
    for s in shapes_in_profile(profile, n_random, rng, None, multiples):
        shape = {}
        for name, dims in s.items():
            r = profile[name]
            dims = list(dims)
            if r["min"][0] <= 1 and len(dims) > 0:
                dims[0] = 1
            vol, opt_vol = float(np.prod(dims[1:])), float(np.prod(r["opt"][1:]))
            if vol > opt_vol:  # shrink the varying dims to the opt size, keeping their ratio
                varying = [d for d in range(1, len(dims)) if r["min"][d] != r["max"][d]]
                f = (opt_vol / vol) ** (1.0 / max(1, len(varying)))
                step = (multiples or {}).get(name) or [1] * len(dims)
                for d in varying:
                    dims[d] = int(min(max(int(dims[d] * f) // int(step[d]) * int(step[d]), r["min"][d]), r["max"][d]))
            shape[name] = {"min": dims, "opt": dims, "max": dims}
        out.append(shape)
    return out


def describe_feeds(feeds: list[Feed]) -> list[dict[str, list[int]]]:
    return [{n: list(a.shape) for n, a in f.items()} for f in feeds]
