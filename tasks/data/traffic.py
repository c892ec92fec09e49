"""Real traffic, read: the shapes a service sees decide min/opt/max (tasks/data/proposal.py proposes the profiles,
tasks/data/proposal_report.py shows and writes them).

A traffic record is a JSON Lines file, one observed request per line mapping each dynamic input to its shape with an
optional ``count`` (``{"x": [1, 3, 736, 1312], "count": 42}``), or a folder of ``.npz``/``.npy`` requests (one per
file; only the array headers are read). Shapes are what the model is fed (after the service's own resizing).

Here: the record read and checked against the model (``read_traffic``, ``check_rules``), which profile serves a
request (``serving``), the dims that vary, and request shapes drawn from the traffic's mix (``TrafficDraws``).
"""
from __future__ import annotations

import json
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks.common.errors import ConfigError
from tasks.graph.models import TensorInfo

KEY = "model.traffic.source"
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



# -- which profile serves a request ------------------------------------------------------------------------------------

def inside(profile: dict, shape: Shape) -> bool:
    return all(all(lo <= d <= hi for d, lo, hi in zip(shape[n], r["min"], r["max"])) for n, r in profile.items()
               if n in shape)


def serving(profiles: list[dict], shape: Shape) -> int | None:
    """The profile the runtime picks for a request (the first that contains it), else None."""
    return next((k for k, p in enumerate(profiles) if inside(p, shape)), None)



# -- draws and the dims that vary --------------------------------------------------------------------------------------

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

