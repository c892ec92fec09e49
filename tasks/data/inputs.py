"""Model inputs for calibration and validation: user arrays, images, or random values inside the profiles."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tasks.common.errors import ConfigError
from tasks.graph.models import TensorInfo
from tasks.data.profiles import ShapeRules, named_ties, shapes_in_profile
from tasks.data.samples import images_batch, list_images
from tasks.common.util import sha256_file

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
    return load_data(path, inputs, profiles, key, limit)[0]


def load_data(path: str, inputs: list[TensorInfo], profiles: list[dict], key: str, limit: int | None = None,
              rules: ShapeRules | None = None) -> tuple[list[Feed], "DataRecord"]:
    """Feeds from .npz/.npy files, and the record of what they are. Per file: arrays with the inputs' own rank hold
    samples along axis 0 and are split into batches that fit a profile; arrays with one more leading axis are a
    stack of batches. `limit` caps the number of samples; dims the model ties (rules) must agree."""
    names = [t.name for t in inputs]
    rules = rules or ShapeRules(named_ties(inputs))
    feeds: list[Feed] = []
    files = []
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
        files.append({"file": f.name, "sha256": sha256_file(f)})
        feeds += _file_feeds(arrays, inputs, profiles, f"{key}: {f.name}")
        if limit and sum(batch_size(x) for x in feeds) >= limit:
            break
    if limit:
        feeds = _cap(feeds, limit)
    if not feeds:
        raise ConfigError(f"{key}={path!r} holds no samples", fix="add at least one sample")
    for i, feed in enumerate(feeds):
        check_feed(feed, inputs, profiles, f"{key} sample {i}", rules)
    record = DataRecord.of(feeds, "file", path=str(path), sha256=data_hash(path, key), files=files)
    return feeds, record


def _file_feeds(arrays: dict[str, np.ndarray], inputs: list[TensorInfo], profiles: list[dict], what: str) -> list[Feed]:
    names = [t.name for t in inputs]
    extra_axes = {t.name: arrays[t.name].ndim - t.rank for t in inputs}
    if all(v == 1 for v in extra_axes.values()):  # a stack of batches
        counts = {n: len(arrays[n]) for n in names}
        if len(set(counts.values())) != 1:
            raise ConfigError(f"{what}: the stacks hold different numbers of batches {counts}",
                              fix="give every input the same number of batches on the leading axis")
        return [{n: arrays[n][i] for n in names} for i in range(counts[names[0]])]
    if all(v == 0 for v in extra_axes.values()):
        return split_batches(arrays, inputs, profiles, what)
    bad = next(t for t in inputs if extra_axes[t.name] not in (0, 1) or extra_axes[t.name] != extra_axes[names[0]])
    raise ConfigError(f"{what}: array {bad.name!r} has shape {list(arrays[bad.name].shape)} but the model's input is "
                      f"{bad.shape} (rank {bad.rank}), and all arrays of a file must take the same form",
                      fix=f"give every input rank {bad.rank} (samples along axis 0) or rank {bad.rank + 1} (a stack of batches)")


def split_batches(arrays: dict[str, np.ndarray], inputs: list[TensorInfo], profiles: list[dict], what: str) -> list[Feed]:
    """Samples along axis 0 -> batches of the opt batch size of the first profile their other dims fit (a static
    batch-1 model gets one sample per feed). Arrays that fit no profile come back whole, for check_feed to refuse."""
    names = [t.name for t in inputs]
    batched = [n for n in names if arrays[n].ndim > 0]
    if not batched:
        return [dict(arrays)]
    counts = {n: arrays[n].shape[0] for n in batched}
    for p in profiles:
        fits = all(all(lo <= d <= hi for d, lo, hi in zip(arrays[n].shape[1:], p[n]["min"][1:], p[n]["max"][1:]))
                   for n in batched)
        if not fits:
            continue
        lo = max(p[n]["min"][0] for n in batched)
        hi = min(p[n]["max"][0] for n in batched)
        if len(set(counts.values())) != 1:  # axis 0 is no batch axis (a graph's nodes and edges): one sample,
            return [dict(arrays)]  # whose dims check_feed holds against the model's ties and the profiles
        if lo > hi:
            continue
        b = min(max(p[batched[0]]["opt"][0], lo), hi)
        n = counts[batched[0]]
        out = [{k: (a[i:i + b] if k in batched else a) for k, a in arrays.items()} for i in range(0, n, b)]
        return [f for f in out if batch_size(f) >= lo] or out[:1]
    return [dict(arrays)]


def batch_size(feed: Feed) -> int:
    """The samples in a feed: the length of axis 0 where every input shares it, else 1 (a feed whose inputs do not
    share axis 0, e.g. a graph's nodes [N, F] beside its edges [2, E], is one sample)."""
    lengths = {int(a.shape[0]) for a in feed.values() if a.ndim > 0}
    return lengths.pop() if len(lengths) == 1 else 1


def _cap(feeds: list[Feed], limit: int) -> list[Feed]:
    """Whole feeds until `limit` samples are reached (a batch is never cut below its profile's minimum)."""
    out, n = [], 0
    for f in feeds:
        if n >= limit:
            break
        out.append(f)
        n += batch_size(f)
    return out


def check_feed(feed: Feed, inputs: list[TensorInfo], profiles: list[dict], what: str, rules: ShapeRules | None = None) -> None:
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
        d = rules.domains.get(t.name) if rules else None
        if d is not None and d.kind == "ids" and d.high is not None and np.issubdtype(a.dtype, np.integer) and \
                (a.min() < -d.high or a.max() >= d.high):  # ONNX Runtime fails on it mid-stage (Gather: [-rows, rows))
            raise ConfigError(f"{what}: input {t.name!r} holds ids from {a.min()} to {a.max()}, outside [0, {d.high}): "
                              f"{d.why}", fix=f"give ids in [0, {d.high}) (the ids the model's tokenizer makes)")
    for t in (rules.ties if rules else []):
        (na, ia), (nb, ib) = t.a, t.b
        da, db = feed[na].shape[ia], feed[nb].shape[ib]
        if t.hard and da != db and not (t.kind == "graph" and 1 in (da, db)):
            raise ConfigError(f"{what}: input {na!r} dim {ia} is {da} but input {nb!r} dim {ib} is {db}; the model needs "
                              f"them equal ({t.why})", fix=f"give {nb!r} the same size in dim {ib} as {na!r}")
    ok = any(all(all(lo <= d <= hi for d, lo, hi in zip(feed[n].shape, r["min"], r["max"])) for n, r in p.items())
             for p in profiles)
    if not ok:
        shapes = {n: list(a.shape) for n, a in feed.items()}
        ranges = [{n: f"{r['min']}..{r['max']}" for n, r in p.items()} for p in profiles]
        raise ConfigError(f"{what}: shapes {shapes} fall outside every profile {ranges}",
                          fix="resize the data or widen model.profiles")


def random_value(t: TensorInfo, shape: list[int], rng: np.random.Generator, domain: Any = None,
                 shapes: dict[str, list[int]] | None = None) -> np.ndarray:
    """Random values for input ``t`` at ``shape``: in its ``domain`` (tasks.graph.meaning.Domain: what the graph shows
    it means) where known, else standard normal floats and 0/1 integers. ``shapes``: the feed's other inputs' shapes
    (the full length a length input counts)."""
    dt = NP_DTYPES.get(t.dtype, np.float32)
    if domain is not None:
        return _in_domain(domain, dt, shape, rng, shapes or {}, t.name)
    if np.issubdtype(dt, np.floating):
        return rng.standard_normal(shape).astype(dt)
    if dt == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    return rng.integers(0, 2, shape).astype(dt)


def _in_domain(d: Any, dt: Any, shape: list[int], rng: np.random.Generator, shapes: dict[str, list[int]],
               name: str) -> np.ndarray:
    if d.kind == "ids":  # rows of a table, or positions of another input's axis (a graph's edges into its nodes)
        high = max(1, int(d.high if d.high is not None else _full_length(d, shape, shapes, name)))
        ids = rng.integers(0, high, shape)
        if d.segments and ids.size >= high:  # segment ids (a node's graph): sorted, every segment present
            ids = np.sort(np.concatenate([np.arange(high), ids.ravel()[high:]])).reshape(shape)
        return ids.astype(dt)
    if d.kind == "size":  # a value that sets a size: near 1, so the shapes it sets stay near the model's own
        from tasks.graph.meaning import SIZE_SPAN
        span = np.log(SIZE_SPAN)
        return np.exp(rng.uniform(-span, span, shape)).astype(dt) if np.issubdtype(dt, np.floating) \
            else rng.integers(1, 3, shape).astype(dt)
    if d.kind == "positive":
        return np.exp(rng.standard_normal(shape)).astype(dt) if np.issubdtype(dt, np.floating) \
            else rng.integers(1, 10, shape).astype(dt)
    if d.kind == "length":
        full = _full_length(d, shape, shapes, name)
        n = rng.integers(max(1, -(-full // 2)), full + 1, shape) if shape else np.asarray(full)
        if n.ndim:
            n.flat[0] = full  # one sample at the full length
        return np.asarray(n).astype(dt)
    # a mask: along its last axis valid from the start, padded at the end (at least one valid position; the first
    # row of each feed unpadded)
    if not shape:
        return np.asarray(d.valid).astype(dt)
    t = shape[-1]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    lengths = rng.integers(max(1, -(-t // 2)), t + 1, rows)
    lengths[0] = t
    valid = (np.arange(t)[None, :] < lengths[:, None]).reshape(shape)
    keep = valid if d.valid else ~valid
    return keep.astype(dt)


def _full_length(d: Any, shape: list[int], shapes: dict[str, list[int]], name: str) -> int:
    """The length a length input counts up to (or an index input's bound): the dim the graph names (an RNN's X's
    time axis, the axis a Range spans), else the smallest non-batch dim of the feed's other inputs (a length no input
    can hold would be no valid length), else 32."""
    if d.of and d.of[0] in shapes and len(shapes[d.of[0]]) > d.of[1]:
        return max(1, int(shapes[d.of[0]][d.of[1]]))
    dims = [x for n, s in shapes.items() if n != name for x in s[1:]]
    return max(1, min(dims)) if dims else 32


def generated_feeds(inputs: list[TensorInfo], profiles: list[dict], n_random: int, seed: int,
                    recipe: Any | None = None, offset: int = 0, multiples: dict | None = None,
                    rules: ShapeRules | None = None, files: list | None = None,
                    notes: list[str] | None = None, each_image_once: bool = True) -> list[Feed]:
    """Feeds at min, opt, max (and n_random random shapes between, each a new draw even where the shape repeats) of
    each profile: images where a recipe says so, else noise. Tied dims (rules; by default the inputs' shared dim names)
    get one value, each dim on its step. A folder's images (``files`` of it when given) are read in turn from
    ``offset``, each at most once in a set: a shape left without images is dropped (and ``notes`` say so), as a
    repeated image would count as new evidence where it is none (``each_image_once=False``: in turn, repeating, for
    an input that is only timed)."""
    rng = np.random.default_rng(seed)
    rules = rules or ShapeRules(named_ties(inputs), dict(multiples or {}))
    by_name = {t.name: t for t in inputs}
    pool = folder_images(recipe, files)
    feeds, used, dropped = [], 0, 0
    for prof in profiles:
        for shape in shapes_in_profile(prof, n_random, rng, rules):
            if pool is not None and each_image_once and recipe["input"] in shape:  # each image once in a set
                n, left = shape[recipe["input"]][0], len(pool) - offset - used
                if n > left:  # the images left, as a smaller batch where the profile allows one
                    dropped += 1
                    if left < max(1, prof[recipe["input"]]["min"][0]):
                        continue
                    shape = {k: [left, *d[1:]] if d and d[0] == n else d for k, d in shape.items()}
            feed = {}
            for name, s in shape.items():
                if recipe is not None and name == recipe["input"]:
                    feed[name] = images_batch(recipe, s, rng, start=offset + used, files=pool)
                    used += s[0] if s else 1
                else:
                    feed[name] = random_value(by_name[name], s, rng, rules.domains.get(name), shape)
            feeds.append(feed)
    if pool is not None and each_image_once and notes is not None and offset + used < len(pool):
        notes.append(f"{len(pool) - offset - used} of the {len(pool) - offset} images of model.images.source="
                     f"{recipe['source']} for this set are not used by its {len(feeds)} drawn shapes (more draws, "
                     "e.g. validation.samples, use them)")
    if dropped and notes is not None:
        notes.append(f"{len(pool) - offset} images of model.images.source={recipe['source']} for this set, each used "
                     f"once: {dropped} drawn shapes got fewer images than their batch or none (add images for more)")
    return feeds


def folder_images(recipe: Any | None, files: list | None = None) -> list | None:
    """The images a recipe draws from a folder (``files`` of it when given), or None (no recipe, synthetic pages)."""
    if recipe is None or str(recipe["source"]).startswith("synthetic:"):
        return None
    return list(files) if files else list_images(str(recipe["source"]), "model.images.source")


def _fixed(shape: dict[str, list[int]]) -> dict:
    return {n: {"min": d, "opt": d, "max": d} for n, d in shape.items()}


def calibration_shapes(profile: dict, n: int, rng: np.random.Generator, rules: ShapeRules | None = None,
                       spread: tuple[float, float] = (0.6, 1.3)) -> list[dict]:
    """n single-sample shapes around the opt shape (batch 1; other dims scaled by a random factor, kept inside the
    profile and on their steps, tied dims alike): calibration sees content at several scales without max-size cost."""
    rules = rules or ShapeRules()
    if rules.traffic is not None:  # requests as they arrive (weighted by count), one sample each
        return [_fixed(s) for s in rules.traffic.draw_single(profile, n, rng)]
    steps = rules.group_steps(profile)
    shapes = []
    for i in range(n):
        f = 1.0 if i == 0 else float(rng.uniform(*spread))
        shape = {}
        for name, r in profile.items():
            dims = []
            for d, (lo, opt, hi) in enumerate(zip(r["min"], r["opt"], r["max"])):
                if lo == hi:
                    dims.append(lo)
                elif d == 0 and lo <= 1:
                    dims.append(1)
                else:
                    step = steps[rules.group((name, d))]
                    dims.append(int(min(max(int(round(opt * f / step)) * step, lo), hi)))
            shape[name] = dims
        shapes.append(_fixed(shape))
    return shapes


def heldout_shapes(profile: dict, n_random: int, rng: np.random.Generator, rules: ShapeRules | None = None) -> list[dict]:
    """Shapes for the accuracy search's held-out set, drawn like validation draws them (min, opt, max, random in
    between: every size and aspect ratio the gate will see) but with batch 1 except the opt and the max shape, which
    keep their batch (the opt batch is the one the model is deployed at: a search judged on single images passed
    PP-OCRv4 rec at 0.995 where validate's batches of 8-16 gave 0.989; the max shape at its batch weighs in the pooled
    figure as validation's largest batches do: PP-OCRv6 det's search judged one 960x960 page, met 0.9951, and
    validation's batches of 4 pages at 768-960 pulled it to 0.9848, their small pages at 0.999). Shrunk to the opt size
    the search passed PP-OCRv4 det at 0.9925 on small pages where validation at 960x960 gave 0.987. ``n_random`` + 3 samples in all: a shape drawn twice (every
    shape of a static profile) is two samples, each with its own content. Drawn once, a static-shape model's search
    judged 1 held-out page: SLANet-plus met 0.9988 on it and 8 calibration pages, then one of 5 validation pages
    decoded 20 table tokens instead of 23."""
    out = []
    corners = {repr(sorted((n, list(r[w])) for n, r in profile.items())) for w in ("min", "opt", "max")}
    for s in shapes_in_profile(profile, n_random + 3 - len(corners), rng, rules or ShapeRules()):  # n_random + 3 in all
        is_opt = any(all(list(dims) == list(profile[name][w]) for name, dims in s.items()) for w in ("opt", "max"))
        shape = {}
        for name, dims in s.items():
            dims = list(dims)
            if dims and profile[name]["min"][0] <= 1 and not is_opt:
                dims[0] = 1
            shape[name] = dims
        out.append(_fixed(shape))
    return out


def describe_feeds(feeds: list[Feed]) -> list[dict[str, list[int]]]:
    return [{n: list(a.shape) for n, a in f.items()} for f in feeds]


@dataclass
class DataRecord:
    """What a stage calibrated or validated on, for summary.json ("data") and the MLflow run: the files and their
    sha256, or the model's image recipe, or random inputs; how many feeds and samples, and their shapes."""

    source: str  # "file" | "images" | "random" | "held-out calibration data"
    feeds: int
    samples: int
    shapes: list[dict] = field(default_factory=list)  # distinct feed shapes, each {"shape": {input: dims}, "feeds": n}
    path: str | None = None
    sha256: str | None = None
    files: list[dict] = field(default_factory=list)  # [{"file", "sha256"}]
    recipe: dict | None = None
    notes: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, feeds: list[Feed], source: str, **kw: Any) -> "DataRecord":
        counts: dict[str, int] = {}
        shapes: dict[str, dict] = {}
        for f in feeds:
            shape = {n: list(a.shape) for n, a in f.items()}
            k = repr(sorted(shape.items()))
            counts[k] = counts.get(k, 0) + 1
            shapes.setdefault(k, shape)
        return cls(source, len(feeds), sum(batch_size(f) for f in feeds),
                   [{"shape": shapes[k], "feeds": counts[k]} for k in shapes], **kw)

    def describe(self) -> str:
        what = {"file": f"{self.path} (sha256 {str(self.sha256)[:12]})",
                "images": f"images ({(self.recipe or {}).get('source')})"}.get(self.source, self.source)
        return f"{what}: {self.samples} samples in {self.feeds} feeds"

    def as_dict(self) -> dict:
        return {"summary": self.describe(), **{k: v for k, v in asdict(self).items() if v not in (None, [], {})}}
