"""Paddle inference models (format: paddle) to ONNX with paddle2onnx, in a subprocess.

Two converters, each the one measured to convert its format correctly:
- legacy `inference.pdmodel` (Paddle 2.x programs): paddle2onnx 1.3.1's native module, loaded from its own folder
  without paddle (its package __init__ imports paddle). paddle2onnx 2.1.0 converts Paddle 2.x rec/cls into ONNX that
  ONNX Runtime refuses; 1.3.1 converts det, rec and cls correctly.
- Paddle 3 `NAME.json` programs: paddle2onnx 2.1.0 with paddlepaddle 3.2.2 (3.3.x breaks PP-OCRv4 det).
The converter runs in a child process: it calls sys.exit on some failures, prints to stdout, and a crash in its
native code must not take the build down. Every result is load-checked in ONNX Runtime.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

from tasks.common.deps import note
from tasks.common.errors import ConfigError, cause
from tasks.graph.edit import rename_values

SUFFIXES = (".pdmodel", ".json")
LEGACY_DIR = Path(sys.prefix) / "paddle2onnx-1.3.1"  # `make paddle` installs paddle2onnx 1.3.1 here (--target)
OPSET = 14
TIMEOUT = 900
INSTALL = "run `make paddle` (installs paddlepaddle 3.2.2 and paddle2onnx 2.1.0 / 1.3.1 into .venv)"


def paddle_files(model_file: Path, key: str = "model.source") -> Path:
    """Check a Paddle inference model: a .pdmodel or .json program with its .pdiparams beside it."""
    if model_file.suffix not in SUFFIXES:
        raise ConfigError(f"{key}={str(model_file)!r} is not a Paddle inference model file (.pdmodel or .json)",
                          file=str(model_file), fix="point model.source at inference.pdmodel or NAME.json (the "
                                                    "program; its NAME.pdiparams beside it)")
    params = model_file.with_suffix(".pdiparams")
    if not params.is_file():
        raise ConfigError(f"{key}: the parameters file {params.name} is missing beside {model_file.name}",
                          file=str(model_file), fix=f"put {params.name} (saved with the program) in {model_file.parent}")
    head = model_file.read_bytes()[:64].lstrip()
    if model_file.suffix == ".json" and not head.startswith(b"{"):
        raise ConfigError(f"{key}: {model_file.name} is not a Paddle 3 program (not JSON)", file=str(model_file),
                          fix="save the model with paddle.jit.save in Paddle 3, or give the legacy inference.pdmodel")
    return params


def _legacy_module() -> Path | None:
    found = sorted((LEGACY_DIR / "paddle2onnx").glob("paddle2onnx_cpp2py_export*.so"))
    return found[0] if found else None


def converter_for(model_file: Path) -> str:
    """'legacy' (paddle2onnx 1.3.1, no paddle) or 'pir' (paddle2onnx 2.1.0 + paddlepaddle); missing -> exit 2."""
    if model_file.suffix == ".pdmodel":
        if _legacy_module() is None:
            raise ConfigError(f"model.format=paddle: converting {model_file.name} needs paddle2onnx 1.3.1, which is not "
                              f"installed (looked in {LEGACY_DIR})", file=str(model_file), fix=INSTALL)
        return "legacy"
    if importlib.util.find_spec("paddle") is None or importlib.util.find_spec("paddle2onnx") is None:
        raise ConfigError(f"model.format=paddle: converting {model_file.name} needs paddlepaddle 3.2.2 and paddle2onnx "
                          "2.1.0, which are not installed", file=str(model_file), fix=INSTALL)
    return "pir"


def converted_onnx(model_file: Path, cache_root: Path) -> tuple[Path, str]:
    """The conversion, content-addressed by program and parameters (preflight and export share it): (onnx, how)."""
    import hashlib
    import shutil
    import tempfile

    from tasks.common.util import sha256_file

    params = paddle_files(model_file)
    note(model_file, params)  # converted in a child process (C++): recorded from the paths it is given
    key = hashlib.sha256(f"{sha256_file(model_file)}{sha256_file(params)}{sha256_file(Path(__file__))}".encode()).hexdigest()[:24]
    final = cache_root / key
    if not (final / "model.onnx").is_file():
        cache_root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache_root, prefix=f".{key}."))
        try:
            how = onnx_from_paddle(model_file, tmp / "model.onnx")["how"]
            (tmp / "how.txt").write_text(how)
            try:
                tmp.rename(final)
            except OSError:  # another process published it first
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final / "model.onnx", (final / "how.txt").read_text()


def onnx_from_paddle(model_file: Path, out_path: Path) -> dict:
    """Convert; returns {"how", "seconds"}. Conversion failures are bad input (exit 2) naming the file."""
    params = paddle_files(model_file)
    kind = converter_for(model_file)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    env = {**os.environ, "GLOG_minloglevel": "2", "FLAGS_call_stack_level": "0", "PYTHONWARNINGS": "ignore"}
    try:
        proc = subprocess.run([sys.executable, "-m", "tasks.sources.paddle", kind, *(str(p.resolve()) for p in (model_file, params, out_path))],
                              capture_output=True, text=True, timeout=TIMEOUT, env=env,
                              cwd=str(Path(__file__).resolve().parents[1]))  # `tasks` importable however trtforge is installed
    except subprocess.TimeoutExpired:
        raise ConfigError(f"paddle2onnx did not finish converting {model_file.name} in {TIMEOUT} s", file=str(model_file),
                          fix="check the model loads in Paddle (paddle.jit.load) and convert it by hand") from None
    if proc.returncode != 0 or not out_path.is_file() or out_path.stat().st_size == 0:
        tail = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        why = next((ln for ln in reversed(tail) if "rror" in ln), tail[-1] if tail else f"exit status {proc.returncode}")
        raise ConfigError(f"paddle2onnx could not convert {model_file.name}: {cause(why)}", file=str(model_file),
                          fix="check it is a Paddle inference model (saved with paddle.jit.save / save_inference_model) "
                              "with its own .pdiparams; an op paddle2onnx lacks needs a newer paddle2onnx")
    _load_check(out_path, model_file)
    import onnx

    model = onnx.load(str(out_path))
    if rename_fetch_outputs(model):
        onnx.save(model, str(out_path))
    version = "1.3.1" if kind == "legacy" else "2.1.0 + paddlepaddle " + _dist_version("paddlepaddle")
    return {"how": f"paddle2onnx {version} ({model_file.suffix})", "seconds": time.perf_counter() - t0}


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


def _load_check(path: Path, model_file: Path) -> None:
    """paddle2onnx can write ONNX that ONNX Runtime refuses (Paddle 2.x rec/cls with 2.1.0): check it loads."""
    import onnxruntime as ort

    from tasks.onnxrt.ort import quiet_onnxruntime

    quiet_onnxruntime()
    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as e:
        raise ConfigError(f"paddle2onnx converted {model_file.name} into ONNX that ONNX Runtime refuses: "
                          f"{cause(e)}", file=str(model_file),
                          fix="a Paddle 2.x program converts with paddle2onnx 1.3.1: give the legacy inference.pdmodel "
                              "(`make paddle` installs it)") from None


def rename_fetch_outputs(model) -> list[str]:
    """paddle2onnx 2.x names outputs fetch_name_N: call them output_N (one name per graph output, in order)."""
    renames = {o.name: f"output_{i}" for i, o in enumerate(model.graph.output) if o.name.startswith("fetch_name_")}
    taken = {v for n in model.graph.node for v in n.output} | {i.name for i in model.graph.input}
    for old, new in list(renames.items()):
        if new in taken:
            del renames[old]
    notes = [f"output {o.name!r} renamed {renames[o.name]!r}" for o in model.graph.output if o.name in renames]
    rename_values(model.graph, renames)  # control-flow bodies' reads too
    return notes


# --- the child process -----------------------------------------------------------------------------------------

def _convert_legacy(model_file: str, params: str, out: str) -> None:
    spec = importlib.util.spec_from_file_location("paddle2onnx_cpp2py_export", str(_legacy_module()))
    c_p2o = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(c_p2o)
    data = c_p2o.export(model_file, params, OPSET, True, False, True, True, True, {}, "onnxruntime", "", "", False)
    Path(out).write_bytes(data)


def _convert_pir(model_file: str, params: str, out: str) -> None:
    import paddle2onnx

    # optimize_tool=None: the default runs Polygraphy folding, which pip-installs packages at run time
    paddle2onnx.export(model_file, params, save_file=out, opset_version=OPSET, verbose=False, optimize_tool=None)


def main(argv: list[str]) -> int:
    kind, model_file, params, out = argv
    try:
        (_convert_legacy if kind == "legacy" else _convert_pir)(model_file, params, out)
    except SystemExit as e:  # paddle2onnx exits on some failures
        print(f"error: paddle2onnx exited ({e.code})", file=sys.stderr)
        return 1
    except Exception as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
