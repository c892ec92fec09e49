"""What a farm build reads, shipped to the worker through the farm's store (flows/farmstore.py).

The submitter collects every file a config key names (`collect`): the config dir, model.source with the ONNX model's
external data files (or a Paddle model's parameters), the user's Python modules (model.factory, accuracy.metric) when
they live outside the Python installation, calibration.data, validation.data, validation.labels, model.traffic.source
and model.images.source. Each file is uploaded once by its sha256; the flow run carries the manifest (key -> files ->
sha256). The worker fetches the files into `<workdir>/items/<item hash>/`, checks every hash, and builds with the
overrides rewritten to those paths (`materialize`). `pkg://` sources and `synthetic:` images stay as they are: every
worker has them. An item's folder is named by its content, so every worker and every manifest that ships the same
files reads them at the same place under its workdir (the shared cache's dependency records rely on it).
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.common import ConfigError, sha256_file, sha256_json

MANIFEST_FORMAT = 1
MANIFEST_TAG = "trtforge.farm.manifest"  # the MLflow run's tag: the hash of what its farm build was shipped
KEY_TAG = "trtforge.farm.key"  # and the build's key as the submitter computed it (the run's cache_key is the worker's)
CONFIG_DIR = "--config-dir"  # the manifest item of the user's config dir
DATA_KEYS = ("calibration.data", "validation.data", "validation.labels", "model.traffic.source", "model.images.source")
MODULE_KEYS = ("model.factory", "accuracy.metric")  # module:function, imported from the working or config dir
SKIP_DIRS = {"__pycache__"}  # (and every hidden folder: tree)


@dataclass
class Item:
    """Files a config key names: `root` holds them (relative names), `main` is the one the key points at (None: the
    key names the folder itself)."""
    key: str
    value: str
    root: Path
    files: list[str] = field(default_factory=list)
    main: str | None = None
    into_config: bool = False  # a module: shipped into the worker's config dir, where imports find it

    def as_dict(self) -> dict:
        return {"key": self.key, "value": self.value, "main": self.main, "into_config": self.into_config,
                "files": {rel: sha256_file(self.root / rel) for rel in self.files}}


def collect(cfg: Any, config_dir: str | None) -> list[Item]:
    """Every file the build of `cfg` reads that a worker cannot have; ConfigError naming the key, the value and the fix
    when one is missing (before anything is uploaded)."""
    from omegaconf import OmegaConf

    from flows.config import config_dir_search

    search = config_dir_search(config_dir)
    items: list[Item] = []
    if config_dir:
        root = Path(config_dir).expanduser().resolve()
        if not root.is_dir():
            raise ConfigError(f"--config-dir {config_dir!r} is not a folder", fix="give the folder of your model/*.yaml")
        outputs = [Path(str(cfg[k])).expanduser().resolve() for k in ("out_dir", "cache_dir")]
        items.append(Item(CONFIG_DIR, config_dir, root, tree(root, skip=outputs)))
    source = OmegaConf.select(cfg, "model.source")
    if source and not str(source).startswith(("pkg://", "npm://")):
        items.append(model_item(cfg, str(source), search))
    for key in MODULE_KEYS:
        value = OmegaConf.select(cfg, key)
        if value and ":" in str(value):
            item = module_item(key, str(value), search)
            if item is not None:
                items.append(item)
    for key in DATA_KEYS:
        value = OmegaConf.select(cfg, key)
        if value and not str(value).startswith("synthetic:"):
            items.append(data_item(key, str(value), search))
    return items


def tree(root: Path, skip: list[Path] = ()) -> list[str]:
    """The files under `root`, without hidden folders (.git, .venv, .trtforge), caches and the `skip` folders (a
    config dir that is the working dir holds the build's own results)."""
    out = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if (p.is_file() and not SKIP_DIRS & set(rel.parts) and not any(x.startswith(".") for x in rel.parts[:-1])
                and not any(d == p or d in p.parents for d in skip)):
            out.append(str(rel))
    return sorted(out)


def model_item(cfg: Any, source: str, search: list[Path]) -> Item:
    from tasks.graph.models import resolve_source

    path = resolve_source(source, "model.source", search)  # (ConfigError naming the key when it is missing)
    names = [path.name]
    if cfg.model.format == "onnx":
        names += external_data(path)
    elif cfg.model.format == "paddle":
        from tasks.sources.paddle import paddle_files

        params = Path(paddle_files(path))
        names.append(str(params.resolve().relative_to(path.parent)) if path.parent in params.resolve().parents
                     else params.name)
    for n in names[1:]:
        if not (path.parent / n).is_file():
            raise ConfigError(f"model.source={source!r}: its weights file {n!r} is missing beside {path.name}",
                              fix=f"put {n} next to {path} (the model names it as its external data)")
    return Item("model.source", source, path.parent, sorted(set(names)), main=path.name)


def external_data(path: Path) -> list[str]:
    """The external data files an ONNX model names (relative to its folder), read without loading the weights."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors

    model = onnx.load(str(path), load_external_data=False)
    return sorted({ExternalDataInfo(t).location for t in _get_all_tensors(model)
                   if t.HasField("data_location") and t.data_location == onnx.TensorProto.EXTERNAL})


def module_item(key: str, value: str, search: list[Path]) -> Item | None:
    """The user's module of `module:function` found the way the build imports it (working dir, then config dir);
    None when it is installed (the workers have it like trtforge's own packages) or lies in the config dir."""
    from tasks.common.usermodules import add_import_paths

    name = value.partition(":")[0]
    add_import_paths(search)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        raise ConfigError(f"{key}={value!r}: module {name!r} not found",
                          fix=f"put {name.replace('.', '/')}.py in the working dir or the config dir")
    origin = Path(spec.origin).resolve()
    installed = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    if installed & set(origin.parents) or any(d.resolve() in origin.parents for d in search):
        return None
    depth = name.count(".")
    if depth or origin.name == "__init__.py":  # a package: ship the whole top-level package
        pkg = origin.parents[depth] if origin.name == "__init__.py" else origin.parents[depth - 1]
        return Item(key, value, pkg.parent, [str(Path(pkg.name) / f) for f in tree(pkg)], into_config=True)
    return Item(key, value, origin.parent, [origin.name], into_config=True)


def data_item(key: str, value: str, search: list[Path]) -> Item:
    path = Path(value).expanduser()
    if key == "model.traffic.source":
        from tasks.data.traffic import traffic_path

        path = traffic_path(value, search)
    if path.is_file():
        return Item(key, value, path.resolve().parent, [path.name], main=path.name)
    if path.is_dir():
        root = path.resolve()
        return Item(key, value, root, sorted(p.name for p in root.iterdir() if p.is_file()))
    raise ConfigError(f"{key}={value!r}: no such file or folder on this machine",
                      fix="give a path that exists where you submit (relative to the working directory); the farm "
                          "ships it to the worker")


def manifest_of(items: list[Item]) -> dict:
    return {"format": MANIFEST_FORMAT, "items": [i.as_dict() for i in items]}


def manifest_hash(manifest: dict) -> str:
    """What the files of a manifest are, whatever paths named them (a rebuild names the config dir absolutely)."""
    return sha256_json([(it["key"], it["main"], it["files"]) for it in manifest["items"]])


def blobs(manifest: dict) -> dict[str, tuple[str, str]]:
    """sha256 -> (the item's key, its relative file name) for every file of the manifest."""
    return {sha: (it["key"], rel) for it in manifest["items"] for rel, sha in it["files"].items()}


def item_folder(workdir: Path, item: dict) -> Path:
    return workdir / "items" / sha256_json(item["files"])[:20]


def materialize(manifest: dict, workdir: Path, fetch) -> tuple[str | None, list[str]]:
    """Fetch the manifest's files (`fetch(sha256, dest)`, which checks the hash) into the workdir; returns the config
    dir to build with and the overrides pointing the keys at the fetched files."""
    from flows.cache import temp_name

    if manifest.get("format") != MANIFEST_FORMAT:
        raise ConfigError(f"the farm manifest has format {manifest.get('format')!r}, this worker reads "
                          f"{MANIFEST_FORMAT}", fix="run the same trtforge version on the submitter and the workers")
    config_files: dict[str, Path] = {}  # the worker's config dir: the user's, and the modules shipped into it
    overrides: list[str] = []
    for item in manifest["items"]:
        folder = item_folder(workdir, item)
        if not (folder / ".complete").is_file():
            tmp = folder.parent / temp_name(folder.name)
            try:
                for rel, sha in item["files"].items():
                    dest = tmp / rel
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    fetch(sha, dest)
                (tmp / ".complete").write_text("")
                if folder.exists():  # an interrupted fetch
                    shutil.rmtree(folder, ignore_errors=True)
                tmp.rename(folder)
            except OSError:
                if not (folder / ".complete").is_file():
                    raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        if item["key"] == CONFIG_DIR or item["into_config"]:
            config_files.update({rel: folder / rel for rel in item["files"]})
        else:
            overrides.append(override(item["key"], folder / item["main"] if item["main"] else folder))
    if not config_files:
        return None, overrides
    config_dir = workdir / "configs" / sha256_json({r: str(p.relative_to(workdir)) for r, p in sorted(config_files.items())})[:20]
    if not (config_dir / ".complete").is_file():  # links to the fetched files: one folder the build searches
        tmp = config_dir.parent / temp_name(config_dir.name)
        for rel, p in config_files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).symlink_to(p)
        (tmp / ".complete").write_text("")
        try:
            tmp.rename(config_dir)
        except OSError:  # another build of the same files made it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    return str(config_dir), overrides


def override(key: str, path: Path) -> str:
    value = str(path)
    return f"{key}={value}" if re.fullmatch(r"[\w/.\-+~]+", value) else f"{key}='{value}'"


def rewritten(overrides: list[str], extra: list[str]) -> list[str]:
    """The user's overrides without the keys the farm points at fetched files, then those."""
    keys = {e.split("=", 1)[0] for e in extra}
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in keys] + extra
