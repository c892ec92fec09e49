"""Which inputs calibrate, which judge the accuracy search and which validate: three disjoint sets.

Policy (summary.json ``data`` reports each set: samples, source, how it was made):

* A sample is one slice along the batch axis (axis 0) of a feed whose inputs all share that axis; a feed whose inputs
  do not (e.g. a recurrent state [2, B, 128] beside x [B, T]) is one indivisible sample. Image folders split by file.
* ``validation.data`` validates when given. Otherwise:
  - a build that calibrates (int8/fp8) holds a quarter of ``calibration.data`` out for validation and another quarter
    for the accuracy search (at most MAX_VALIDATION / MAX_SEARCH samples); calibration takes the rest (at most
    ``calibration.samples``);
  - a build that does not calibrate (fp32/fp16) validates on all of ``calibration.data`` when given: data the user
    gave for one purpose checks the other; an fp16 build that may search holds the search's samples out of it (or,
    with only ``validation.data`` given, out of that: the search judges the kind of data validate judges);
  - else the model's images (a folder split by file, or synthetic pages rendered from separate seeds), else random
    values inside the profiles (drawn from separate seeds).
* When the data is too small to hold samples out, the split says so (``notes``): the search judges on the
  calibration samples themselves, and validation uses what is left (the images recipe, else random inputs).
* The same sample given in both ``calibration.data`` and ``validation.data`` is refused before any work.

Sets made from a recipe or at random are made lazily (``DataSet.feeds``); ``key`` is what their content depends on
(the cache key part), known without making them.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np

from tasks.data.inputs import batch_size, calibration_shapes, generated_feeds, heldout_shapes, split_batches
from tasks.data.sets import DataSet, DataSplit, Feed, UserData
from tasks.common.errors import ConfigError
from tasks.graph.models import TensorInfo
from tasks.data.profiles import ShapeRules
from tasks.data.samples import GENERATOR_VERSION, list_images

HOLD_OUT_SHARE = 0.25  # of the user's samples, for validation, and again for the search
MAX_VALIDATION = 64  # samples held out for validation at most
MAX_SEARCH = 8  # samples held out for the accuracy search at most (each candidate runs on all of them)
SEARCH_RANDOM_SHAPES = 5  # generated search set: min, opt, max and this many random shapes (8 samples, as MAX_SEARCH)


def split_data(*, inputs: list[TensorInfo], profiles: list[dict], rules: ShapeRules, calibrate: bool, search: bool,
               validate: bool, calibration_data: UserData | None = None, validation_data: UserData | None = None,
               recipe: dict | None = None, calibration_samples: int = 16, validation_samples: int = 4,
               seed: int = 0, validation_seed: int = 0, labelled: bool = False) -> DataSplit:
    """The three sets for one build (see the module doc). ``calibrate``/``search``/``validate``: which sets it needs.
    ``labelled``: validation.labels label every sample of ``validation_data``, which then validates whole."""
    split = DataSplit()
    gen = _Generated(inputs, profiles, rules, recipe, seed)
    if calibration_data is not None and validation_data is not None:
        _refuse_overlap(calibration_data, validation_data, profiles)
    if validate and validation_data is not None:
        notes: list[str] = []
        units = _distinct_units(validation_data, profiles, notes)
        feeds = validation_data.feeds if not notes else _batches(units, inputs, profiles)
        split.validation = _from_user(validation_data, "validation", feeds, inputs, profiles, notes=notes)

    if calibrate and calibration_data is not None:
        _hold_out_of_user_data(split, calibration_data, inputs, profiles, search, validate, calibration_samples, seed)
    elif calibrate:  # the model's images, or random inputs
        _hold_out_of_generated(split, gen, search, validate, calibration_samples, validation_samples,
                               validation_seed, seed)

    elif search:  # a build that does not calibrate (fp16) but searches: its own held-out samples, none validates
        if calibration_data is not None:
            _search_of_user_data(split, calibration_data, gen, inputs, profiles, validate, seed)
        elif validation_data is not None and validate and not labelled:  # the search judges what validate judges
            split.validation = None
            _search_of_user_data(split, validation_data, gen, inputs, profiles, validate, seed)
        else:
            _search_of_generated(split, gen, validate, validation_samples, validation_seed, seed)

    if validate and split.validation is None:
        if not calibrate and calibration_data is not None:
            notes = ["the build does not calibrate: the calibration data validates it"]
            units = _distinct_units(calibration_data, profiles, notes)
            feeds = calibration_data.feeds if len(notes) == 1 else _batches(units, inputs, profiles)
            split.validation = _from_user(calibration_data, "validation", feeds, inputs, profiles, notes=notes)
        else:  # the images recipe, unless calibration took every image of its folder; else random inputs
            used_up = calibrate and calibration_data is None and gen.image_files() is not None
            split.validation = gen.validation(validation_samples, validation_seed, recipe_ok=not used_up)
    if split.validation is not None:
        split.validation.notes += split.notes
    return split


def _hold_out_of_user_data(split: DataSplit, calibration_data: UserData, inputs: list[TensorInfo],
                           profiles: list[dict], search: bool, validate: bool, calibration_samples: int,
                           seed: int) -> None:
    """A build that calibrates on the user's data: its samples held out for validation and the search, the rest
    calibrates; the notes say what is too few to hold out."""
    units = _distinct_units(calibration_data, profiles, split.notes)
    order = list(np.random.default_rng(seed).permutation(len(units)))
    n = len(units)
    n_val = min(MAX_VALIDATION, math.ceil(n * HOLD_OUT_SHARE)) if validate and split.validation is None else 0
    n_search = min(MAX_SEARCH, math.ceil(n * HOLD_OUT_SHARE)) if search else 0
    if n - n_val - n_search < 1:  # too few: validation first (it gates), then the search
        n_search = max(0, n - n_val - 1) if n_val else max(0, n - 1)
        n_val = min(n_val, max(0, n - 1))
        n_search = min(n_search, max(0, n - n_val - 1))
    val_idx, search_idx = order[:n_val], order[n_val:n_val + n_search]
    cal_idx = order[n_val + n_search:]
    cal_units = _cap([units[i] for i in sorted(cal_idx)], calibration_samples)
    unread = len(cal_idx) - len(cal_units)
    split.calibration = _from_user(calibration_data, "calibration", _batches(cal_units, inputs, profiles),
                                   inputs, profiles, held=(n_val, n_search), notes=[
                                       f"calibration.data holds {n} distinct samples: {n_val} validate, {n_search} "
                                       f"judge the accuracy search, {len(cal_units)} calibrate and {unread} are not "
                                       f"used (calibration.samples={calibration_samples}: raise it to calibrate on "
                                       "them)"] if unread else None)
    if n_search:
        split.search = _from_user(calibration_data, "search", _batches([units[i] for i in sorted(search_idx)],
                                                                         inputs, profiles), inputs, profiles)
    elif search:
        split.notes.append(f"calibration.data holds {n} samples: too few to hold any out for the accuracy search, "
                           "which judges on the calibration samples themselves")
    if n_val:
        split.validation = _from_user(calibration_data, "validation", _batches([units[i] for i in sorted(val_idx)],
                                                                             inputs, profiles), inputs, profiles)
    elif validate and split.validation is None:
        split.notes.append(f"calibration.data holds {n} samples: too few to hold any out for validation "
                           "(give validation.data=... for a check on real inputs)")


def _hold_out_of_generated(split: DataSplit, gen: "_Generated", search: bool, validate: bool, calibration_samples: int,
                           validation_samples: int, validation_seed: int, seed: int) -> None:
    """A build that calibrates on the model's images (a folder split by file) or on rendered pages or random inputs."""
    files = gen.image_files()
    if files is not None:
        n = len(files)
        n_val = math.ceil(n * HOLD_OUT_SHARE) if validate and split.validation is None and n >= 3 else 0
        n_search = math.ceil(n * HOLD_OUT_SHARE) if search and n >= 3 else 0
        order = [files[i] for i in np.random.default_rng(seed).permutation(n)]
        val_files, search_files, cal_files = order[:n_val], order[n_val:n_val + n_search], order[n_val + n_search:]
        split.calibration = gen.calibration(calibration_samples, cal_files)
        if n_search:
            split.search = gen.search(search_files)
        elif search:
            split.notes.append(f"model.images.source holds {n} images: too few to hold any out for the accuracy "
                               "search, which judges on the calibration images themselves")
        if n_val:
            split.validation = gen.validation(validation_samples, validation_seed, val_files)
        elif validate and split.validation is None:
            split.notes.append(f"model.images.source holds {n} images: too few to hold any out for validation")
    else:
        split.calibration = gen.calibration(calibration_samples)
        if search:
            split.search = gen.search()


def _search_of_user_data(split: DataSplit, calibration_data: UserData, gen: "_Generated", inputs: list[TensorInfo],
                         profiles: list[dict], validate: bool, seed: int) -> None:
    """A build that does not calibrate but searches (fp16), on the user's data (``calibration_data``: calibration.data,
    or validation.data when that is all the user gave): the search's samples held out, the rest validates unless
    validation has data of its own. The search judges the data validate judges, not generated values beside it."""
    units = _distinct_units(calibration_data, profiles, split.notes)
    n = len(units)
    order = list(np.random.default_rng(seed).permutation(n))
    own_validation = not validate or split.validation is not None
    n_search = min(MAX_SEARCH, n if own_validation else math.ceil(n * HOLD_OUT_SHARE)) \
        if own_validation or n >= 2 else 0
    if n_search:
        split.search = _from_user(calibration_data, "search", _batches(
            [units[i] for i in sorted(order[:n_search])], inputs, profiles), inputs, profiles,
            held=(0, n_search) if not own_validation else (0, 0))
        if not own_validation:
            split.validation = _from_user(
                calibration_data, "validation", _batches([units[i] for i in sorted(order[n_search:])], inputs,
                                                         profiles), inputs, profiles, held=(n - n_search, 0),
                notes=[(f"{calibration_data.key} validates the build, less" if calibration_data.key == "validation.data"
                        else "the build does not calibrate: the calibration data validates it, less") +
                       " the samples held out for the fp16 accuracy search"])
    else:
        split.search = gen.search()
        split.notes.append(f"{calibration_data.key} holds {n} sample: too few to hold one out for the fp16 accuracy "
                           "search, which judges on generated inputs")
        if calibration_data.key == "validation.data" and split.validation is None:
            split.validation = _from_user(calibration_data, "validation", calibration_data.feeds, inputs, profiles)


def _search_of_generated(split: DataSplit, gen: "_Generated", validate: bool, validation_samples: int,
                         validation_seed: int, seed: int) -> None:
    """A build that does not calibrate but searches (fp16), on the model's images (a folder split by file), rendered
    pages or random inputs."""
    files = gen.image_files()
    if files is not None and len(files) >= 3 and validate and split.validation is None:
        n = len(files)
        order = [files[i] for i in np.random.default_rng(seed).permutation(n)]
        n_search = math.ceil(n * HOLD_OUT_SHARE)
        split.search = gen.search(order[:n_search])
        split.validation = gen.validation(validation_samples, validation_seed, order[n_search:])
    elif files is None:  # rendered pages or random inputs, from seeds of their own, at every shape validate draws
        if validate and split.validation is None:
            split.validation = gen.validation(validation_samples, validation_seed)
        split.search = gen.search(judged=split.validation if split.validation is not None and
                                  split.validation.kind != "file" else None)
    else:
        split.notes.append(f"model.images.source holds {len(files)} images: too few to hold any out for the "
                           "fp16 accuracy search, which does not run")


# --- the user's arrays, sample by sample ----------------------------------------------------------------------

def _units(feeds: list[Feed], profiles: list[dict]) -> list[tuple[Feed, bool]]:
    """(sample, splittable) pairs: each feed sliced along axis 0 into its samples (the profile's minimum batch each)
    where all its inputs share that axis, else the whole feed as one indivisible sample."""
    out = []
    for f in feeds:
        lengths = {a.shape[0] for a in f.values() if a.ndim > 0}
        b = lengths.pop() if len(lengths) == 1 else None
        lo = _min_batch(f, profiles)
        if b is None or lo is None or b <= lo or b % lo:
            out.append((f, False))
            continue
        out += [({k: (a[i:i + lo] if a.ndim > 0 else a) for k, a in f.items()}, True) for i in range(0, b, lo)]
    return out


def _distinct_units(data: UserData, profiles: list[dict], notes: list[str]) -> list[tuple[Feed, bool]]:
    """The user's samples, each once: a sample repeated inside the data (the same array saved twice, a file copied)
    would count as new evidence where it is none; the note says how many repeats were dropped."""
    units, seen = [], set()
    all_units = _units(data.feeds, profiles)
    for u in all_units:
        d = _digest(u[0])
        if d not in seen:
            seen.add(d)
            units.append(u)
    if len(units) < len(all_units):
        notes.append(f"{data.key}={data.path!r} holds {len(all_units)} samples of which {len(units)} are distinct: "
                     f"{len(all_units) - len(units)} repeats are not used (each sample counts once)")
    return units


def _min_batch(feed: Feed, profiles: list[dict]) -> int | None:
    """The smallest batch the first profile that fits the feed's other dims accepts (None: no profile fits)."""
    for p in profiles:
        if all(n in p and all(lo <= d <= hi for d, lo, hi in zip(a.shape[1:], p[n]["min"][1:], p[n]["max"][1:]))
               for n, a in feed.items() if a.ndim > 0):
            return max([p[n]["min"][0] for n, a in feed.items() if a.ndim > 0 and n in p] or [1])
    return None


def _cap(units: list[tuple[Feed, bool]], limit: int) -> list[tuple[Feed, bool]]:
    out, n = [], 0
    for u in units:
        if n >= limit:
            break
        out.append(u)
        n += batch_size(u[0])
    return out


def _batches(units: list[tuple[Feed, bool]], inputs: list[TensorInfo], profiles: list[dict]) -> list[Feed]:
    """Samples back into feeds of the profile's opt batch: splittable samples of the same shape are concatenated and
    batched (tasks.data.inputs.split_batches), indivisible ones stay as they are; order kept."""
    feeds: list[Feed] = []
    group: list[Feed] = []

    def flush() -> None:
        if group:
            arrays = {k: (np.concatenate([g[k] for g in group]) if group[0][k].ndim > 0 else group[0][k])
                      for k in group[0]}
            feeds.extend(split_batches(arrays, inputs, profiles, "held-out data"))
            group.clear()

    for feed, splittable in units:
        sig = {k: a.shape[1:] for k, a in feed.items()}
        if not splittable:
            flush()
            feeds.append(feed)
        elif group and {k: a.shape[1:] for k, a in group[0].items()} != sig:
            flush()
            group.append(feed)
        else:
            group.append(feed)
    flush()
    return feeds


def _digest(feed: Feed) -> str:
    h = hashlib.sha256()
    for k in sorted(feed):
        a = np.ascontiguousarray(feed[k])
        h.update(f"{k}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _refuse_overlap(cal: UserData, val: UserData, profiles: list[dict]) -> None:
    seen = {_digest(u) for u, _ in _units(cal.feeds, profiles)}
    shared = sum(_digest(u) in seen for u, _ in _units(val.feeds, profiles))
    if shared:
        same = " (the same files)" if cal.sha256 == val.sha256 else ""
        raise ConfigError(f"calibration.data={cal.path!r} and validation.data={val.path!r} share {shared} samples{same}: "
                          "a build would be judged on data it was calibrated on",
                          fix="give validation.data samples that calibration.data does not hold, or leave validation.data "
                              "unset and trtforge holds samples of calibration.data out for validation")


def _from_user(data: UserData, purpose: str, feeds: list[Feed], inputs, profiles, held: tuple[int, int] = (0, 0),
               notes: list[str] | None = None) -> DataSet:
    what = f"{data.key} ({data.path}, sha256 {data.sha256[:12]})"
    if purpose != data.key.split(".")[0] or held != (0, 0):
        part = {"calibration": "the samples not held out", "search": "samples held out for the accuracy search",
                "validation": "samples held out for validation"}[purpose]
        what = f"{part} of {what}"
    digest = hashlib.sha256("".join(_digest(f) for f in feeds).encode()).hexdigest()
    return DataSet(purpose, "file", what, {"data": data.sha256, "samples": digest}, make=lambda: feeds,
                   notes=list(notes or []), files=data.files)


# --- sets made from the model's images recipe or at random ----------------------------------------------------

class _Generated:
    def __init__(self, inputs, profiles, rules, recipe, seed):
        self.inputs, self.profiles, self.rules, self.recipe, self.seed = inputs, profiles, rules, recipe, seed

    def image_files(self) -> list[str] | None:
        """The recipe's image files (a folder), or None (synthetic pages or no recipe)."""
        src = str((self.recipe or {}).get("source", ""))
        if not src or src.startswith("synthetic:"):
            return None
        return [str(f) for f in list_images(src, "model.images.source")]

    def _domain_key(self) -> dict:
        return _domain_key_of(self.rules)

    def meaning_notes(self, recipe: dict | None) -> list[str]:
        """What the random inputs of a generated set were drawn as, where the graph shows what they mean."""
        drawn = {n: d for n, d in self.rules.domains.items() if recipe is None or n != recipe.get("input")}
        if not drawn:
            return []
        return ["random inputs drawn in the domain the graph shows: " +
                "; ".join(d.describe(n) for n, d in sorted(drawn.items()))]

    def _kind_source(self, files: list[str] | None) -> tuple[str, str, dict]:
        if self.recipe is None:
            return "random", "random inputs inside the profiles", {}
        src = str(self.recipe["source"])
        if src.startswith("synthetic:"):
            return "synthetic", f"images rendered by model.images.source={src}", {"recipe": self.recipe}
        from tasks.common.util import sha256_file

        names = sorted(files or [])
        return "images", f"{len(names)} images of model.images.source={src}", {
            "recipe": self.recipe, "images": [(n.rsplit('/', 1)[-1], sha256_file(n)) for n in names]}

    def calibration(self, samples: int, files: list[str] | None = None) -> DataSet:
        rng = np.random.default_rng(self.seed + 1000)
        notes = []
        if files is not None and len(files) < samples:  # one image per sample, each once
            notes.append(f"calibration has {len(files)} images of model.images.source, one sample each "
                         f"(calibration.samples={samples} asks for more: add images to calibrate on more)")
            samples = len(files)
        elif files is not None and len(files) > samples:
            notes.append(f"calibration has {len(files)} images of model.images.source and takes {samples} "
                         f"(calibration.samples={samples}): {len(files) - samples} are not used (raise "
                         "calibration.samples to calibrate on them)")
        shapes = calibration_shapes(self.profiles[0], samples, rng, self.rules)
        kind, source, key = self._kind_source(files)

        def make() -> list[Feed]:
            return [generated_feeds(self.inputs, [s], 0, self.seed + 1000 + i, recipe=self.recipe, offset=i,
                                    files=files, rules=self.rules)[0] for i, s in enumerate(shapes)]
        return DataSet("calibration", kind, source, {**key, "shapes": shapes, "seed": self.seed + 1000,
                                                     "generator": GENERATOR_VERSION, **self._domain_key()}, make,
                       notes=self.meaning_notes(self.recipe) + notes,
                       files=_listed(files))

    def search(self, files: list[str] | None = None, judged: DataSet | None = None) -> DataSet:
        """The search's held-out set: the first profile's shapes as ``heldout_shapes`` draws them, every other
        profile's min, opt and max, and, given the set validate will judge (``judged``, generated too), each of its
        shapes not drawn already: the search judges every shape validate judges, each with content of its own."""
        rng = np.random.default_rng(self.seed + 5000)
        shapes = heldout_shapes(self.profiles[0], SEARCH_RANDOM_SHAPES, rng, self.rules)
        shapes += [_fixed({n: r[w] for n, r in p.items()}) for p in self.profiles[1:] for w in ("min", "opt", "max")]
        kind, source, key = self._kind_source(files)
        starts = [0] * len(shapes)
        notes = []
        if files is not None:  # a folder's images, each once: the shapes its images cover
            kept, used, name = [], 0, self.recipe["input"]
            for sh in shapes:
                n = sh[name]["opt"][0] if name in sh and sh[name]["opt"] else 1
                if used + n <= len(files):
                    kept.append((sh, used))
                    used += n
            if len(kept) < len(shapes):
                notes.append(f"the accuracy search has {len(files)} images of model.images.source, each used once: "
                             f"{len(shapes) - len(kept)} of its {len(shapes)} shapes got none (add images for more)")
            elif used < len(files):
                notes.append(f"the accuracy search's {len(shapes)} shapes take {used} of its {len(files)} images of "
                             f"model.images.source: {len(files) - used} are not used")
            shapes, starts = [k[0] for k in kept], [k[1] for k in kept]

        def make() -> list[Feed]:
            # validate's other shapes are added to generated values only: a folder's images go once each to the shapes above
            drawn = [_fixed(s) for s in _distinct_shapes(judged.feeds)] if judged is not None and files is None else []
            every = shapes + [s for s in drawn if s not in shapes]
            return [generated_feeds(self.inputs, [s], 0, self.seed + 5000 + i, recipe=self.recipe,
                                    offset=(starts[i] if files is not None and i < len(starts) else 10_000 + i),
                                    files=files, rules=self.rules)[0]
                    for i, s in enumerate(every)]
        return DataSet("search", kind, source, {**key, "shapes": shapes, "seed": self.seed + 5000,
                                                "generator": GENERATOR_VERSION, **self._domain_key(),
                                                **({"judged": judged.key} if judged is not None else {})},
                       make, notes=self.meaning_notes(self.recipe) + notes, files=_listed(files))

    def validation(self, samples: int, seed: int, files: list[str] | None = None, recipe_ok: bool = True) -> DataSet:
        recipe = self.recipe if recipe_ok else None
        gen = self if recipe_ok else _Generated(self.inputs, self.profiles, self.rules, None, self.seed)
        kind, source, key = gen._kind_source(files)
        notes = [f"shapes drawn on steps {self.rules.inferred} inferred from the profiles (set model.shape_multiple "
                 "to choose)"] if self.rules.inferred else []
        notes += self.meaning_notes(recipe)

        def make() -> list[Feed]:  # notes: a folder's images, each once, may leave shapes without images
            return generated_feeds(self.inputs, self.profiles, samples, seed, recipe=recipe, rules=self.rules,
                                   files=files, notes=notes)
        return DataSet("validation", kind, source, {**key, "samples": samples, "seed": seed,
                                                    "rules": self.rules.as_dict(), "generator": GENERATOR_VERSION},
                       make, notes=notes, files=_listed(files))


def _fixed(shape: dict) -> dict:
    """A shape ({input: dims}) as a one-shape profile, as ``heldout_shapes`` gives its shapes."""
    return {n: {"min": list(d), "opt": list(d), "max": list(d)} for n, d in shape.items()}


def _distinct_shapes(feeds: list[Feed]) -> list[dict[str, list[int]]]:
    """The distinct shapes of ``feeds`` ({input: dims}), in order."""
    out: list[dict[str, list[int]]] = []
    for f in feeds:
        s = {n: list(a.shape) for n, a in f.items()}
        if s not in out:
            out.append(s)
    return out


def _domain_key_of(rules: ShapeRules) -> dict:
    return {"domains": {n: d.as_dict() for n, d in sorted(rules.domains.items())}} if rules.domains else {}


def _listed(files: list[str] | None) -> list[dict]:
    return [{"file": f.rsplit("/", 1)[-1]} for f in sorted(files)] if files else []

