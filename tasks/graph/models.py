"""Finding and reading models: `pkg://` sources, ONNX loading with clear errors, input specs."""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from tasks.common.errors import ConfigError

SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")

ONNX_DTYPES = {
    1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool", 10: "float16", 11: "float64",
    16: "bfloat16",
}


def check_safe_name(key: str, value: str) -> None:
    """Names become file and folder names: refuse anything that could leave its folder."""
    if not isinstance(value, str) or not SAFE_NAME.match(value) or ".." in value:
        raise ConfigError(
            f"{key}={value!r} is not a safe name (it is used in file paths)",
            fix=f"use letters, digits, '_', '-', '.' only, e.g. {key}=my_model",
        )


def resolve_source(source: str | None, key: str = "model.source", search: list[Path] | None = None) -> Path:
    """A file path or pkg://PACKAGE/RELATIVE/PATH (found without importing the package)."""
    if not source:
        raise ConfigError(f"{key} is not set", fix=f"set {key}=path/to/model.onnx or pkg://PACKAGE/REL/PATH")
    if source.startswith("pkg://"):
        rest = source[len("pkg://"):]
        pkg, _, rel = rest.partition("/")
        if not pkg or not rel:
            raise ConfigError(f"{key}={source!r} is not of the form pkg://PACKAGE/RELATIVE/PATH",
                              fix="e.g. pkg://rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx")
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"{key}={source!r}: package {pkg!r} is not installed",
                              fix=f"pip install the package that provides {pkg!r}, or point {key} at a file")
        root = Path(list(spec.submodule_search_locations)[0]).resolve()
        path = (root / rel).resolve()
        if root not in path.parents:
            raise ConfigError(f"{key}={source!r} leaves the package folder", fix="remove '..' from the path")
        if not path.is_file():
            raise ConfigError(f"{key}={source!r}: no file {rel!r} in package {pkg!r} ({root})",
                              fix="check the relative path inside the package")
        return path
    path = Path(source).expanduser()
    candidates = [path] if path.is_absolute() else [path] + [Path(d) / path for d in (search or [])]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise ConfigError(f"{key}={source!r}: file not found", fix="give an existing path (relative to the working directory or the config dir)")


@dataclass
class TensorInfo:
    name: str
    dtype: str
    shape: list  # ints, or str for symbolic/unknown dims

    @property
    def rank(self) -> int:
        return len(self.shape)

    def is_static(self) -> bool:
        return all(isinstance(d, int) and d > 0 for d in self.shape)


def value_dims(vi) -> list:
    """A value's dims: ints where known, else the symbolic name (or '?')."""
    dims = []
    for d in vi.type.tensor_type.shape.dim:
        if d.HasField("dim_value") and d.dim_value > 0:
            dims.append(int(d.dim_value))
        else:
            dims.append(d.dim_param or "?")
    return dims


def graph_io(model) -> tuple[list[TensorInfo], list[TensorInfo]]:
    inits = {i.name for i in model.graph.initializer}
    ins = [TensorInfo(i.name, ONNX_DTYPES.get(i.type.tensor_type.elem_type, str(i.type.tensor_type.elem_type)), value_dims(i))
           for i in model.graph.input if i.name not in inits]
    outs = [TensorInfo(o.name, ONNX_DTYPES.get(o.type.tensor_type.elem_type, str(o.type.tensor_type.elem_type)), value_dims(o))
            for o in model.graph.output]
    return ins, outs


MAX_PROTO = 1_800_000_000  # above this, weights go to a side file (protobuf's 2 GB limit)


def save_onnx(model, path: Path) -> None:
    import onnx

    if model.ByteSize() > MAX_PROTO:
        onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")
    else:
        onnx.save(model, str(path))
