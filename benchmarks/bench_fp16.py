"""trtforge's fp16 conversion (`tasks.fp16.convert.fp16_from_onnx`) next to ModelOpt AutoCast on the zoo's ONNX models.

    .venv/bin/python benchmarks/bench_fp16.py [--models a,b]
    .venv/bin/pip install --no-deps -r benchmarks/modelopt-requirements.txt   # ModelOpt, not a trtforge dependency

For each model of benchmarks/zoo/ (format onnx, package installed): the exported, sanitized fp32 graph (what the
build stage converts), then both converters on it: conversion seconds, the lowest cosine of any output to fp32 in
ONNX Runtime over the min/opt/max shapes of the profile (trtforge's own validation draws, random values), and whether
TensorRT-RTX builds the result for sm_86 with the model's profiles (engine MB, or the first error).
AutoCast runs as documented for mixed precision: `convert_to_mixed_precision(path, keep_io_types=True,
calibration_data=<the opt-shape feed>)` (its reference run picks the nodes to keep in fp32).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import zoo  # noqa: E402


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    if not np.isfinite(b).all():
        return float("nan")
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return 1.0 if na == nb == 0 else float(a @ b / (na * nb)) if na and nb else 0.0


def run(model_bytes: bytes, feeds: list[dict]) -> list[list[np.ndarray]]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    sess = ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return [sess.run(None, {k: v for k, v in f.items() if k in names}) for f in feeds]


def trt_build(path: Path, profiles: list[dict]) -> str:
    from tasks.trt import Backend
    from tasks.common import TrtforgeError
    from tasks.common import quiet_native

    try:
        with quiet_native():
            engine = Backend("tensorrt_rtx").build_engine(str(path), profiles, "8.6")
        return f"{len(engine) / 1e6:.1f} MB"
    except TrtforgeError as e:
        return "failed: " + e.message[:90]


def measure(name: str, convert, fp32_path: Path, feeds: list[dict], ref: list, profiles: list[dict], tmp: Path) -> dict:
    import onnx

    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = convert(fp32_path)
    except Exception as e:
        return {"seconds": time.perf_counter() - t0, "cosine": None, "trt": f"convert failed: {type(e).__name__}: {str(e)[:80]}"}
    seconds = time.perf_counter() - t0
    path = tmp / f"{name}.{convert.__name__}.onnx"
    onnx.save(model, str(path))
    try:
        outs = run(path.read_bytes(), feeds)
        cos = min(cosine(a, b) for r, o in zip(ref, outs) for a, b in zip(r, o))
    except Exception as e:
        cos = f"ORT failed: {str(e).splitlines()[0][:80]}"
    return {"seconds": seconds, "cosine": cos, "trt": trt_build(path, profiles)}


def ours(path: Path):
    import onnx

    from tasks.fp16 import fp16_from_onnx

    return fp16_from_onnx(onnx.load(str(path)))[0]


def autocast(path: Path):
    from modelopt.onnx.autocast import convert_to_mixed_precision

    return convert_to_mixed_precision(str(path), low_precision_type="fp16", keep_io_types=True,
                                      calibration_data=str(path.with_suffix(".opt.npz")))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models")
    args = ap.parse_args()
    import logging

    logging.disable(logging.WARNING)
    from omegaconf import OmegaConf

    from tasks.sources import onnx_from_model
    from tasks.data import generated_feeds
    from tasks.graph import load_onnx
    from tasks.graph import graph_io

    names = args.models.split(",") if args.models else [n for n in zoo.zoo_models()
                                                        if zoo.read_model(n).get("format", "onnx") == "onnx"]
    tmp = Path(tempfile.mkdtemp(prefix="trtforge-fp16-"))
    print(f"| model | converter | seconds | cosine_min | TensorRT-RTX sm_86 |\n|---|---|---|---|---|")
    for name in names:
        if zoo.missing_package(name):
            continue
        cfg = OmegaConf.create(zoo.read_model(name))
        profiles = [{k: {kk: list(vv) for kk, vv in r.items()} for k, r in p.items()} for p in cfg.get("profiles", [])]
        fp32_path = onnx_from_model(cfg, profiles, tmp / f"{name}.onnx", search=[zoo.ZOO]).files["onnx"]
        inputs = graph_io(load_onnx(fp32_path))[0]
        static = {t.name: {"min": t.shape, "opt": t.shape, "max": t.shape} for t in inputs if t.is_static()}
        feeds = generated_feeds(inputs, [static | p for p in profiles] or [static], 0, 0)
        for f in feeds:  # Silero's sample rate: 16000 or 8000, not a random integer
            if "sr" in f:
                f["sr"] = np.array(16000, f["sr"].dtype)
        opt = feeds[1] if len(feeds) > 1 else feeds[0]
        np.savez(fp32_path.with_suffix(".opt.npz"), **opt)  # one batch at the opt shape
        ref = run(fp32_path.read_bytes(), feeds)
        for convert in (ours, autocast):
            r = measure(name, convert, fp32_path, feeds, ref, profiles, tmp)
            cos = r["cosine"] if isinstance(r["cosine"], str) or r["cosine"] is None else f"{r['cosine']:.5f}"
            print(f"| {name} | {'trtforge' if convert is ours else 'AutoCast'} | {r['seconds']:.2f} | {cos} | {r['trt']} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
