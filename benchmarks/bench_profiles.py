"""Profiles from traffic vs one hand-written wide profile, on the same traffic.

The traffic: benchmarks/traffic_data.py (document pages from phones and scanners as PP-OCRv4 det is fed them, batches
1..4, 20 009 requests). The model: the default det model (PP-OCRv4 det, fp32 graph). Compared, for
- wide: the profile in conf/model/ppocr_det.yaml (min 1x3x32x32, opt 1x3x640x640, max 4x3x1280x1280), the usual
  hand-written guess;
- proposed: what `python -m flows.profiles model=ppocr_det traffic.source=...` proposes (tasks/data/traffic.py);
columns:
- requests covered (a request outside every profile fails at run time);
- activation memory at max (MiB): peak live intermediate tensors at each profile's max, fp32, ONNX shape inference
  (an estimate of what the engine sizes its activations for; the largest over the profiles);
- mean |FLOPs - opt FLOPs| / opt FLOPs of each covered request against the opt of the profile the runtime picks for
  it (the first that contains it): the proxy for kernel fit a host without a GPU can compute (TensorRT tunes kernels
  for opt);
- engine size and build time: real TensorRT-RTX builds for sm_86 (CPU-only AOT), `--opt-level` (default 3, the
  build's default), and the raw library call's time is the build time.

    .venv/bin/python benchmarks/bench_profiles.py [--opt-level 3] [--target-cc 8.6]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.traffic_data import document_traffic  # noqa: E402

SOURCE = "pkg://rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"
WIDE = [{"x": {"min": [1, 3, 32, 32], "opt": [1, 3, 640, 640], "max": [4, 3, 1280, 1280]}}]


def table(head: list[str], rows: list[list[str]]) -> str:
    w = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda r: "| " + " | ".join(str(x).ljust(n) for x, n in zip(r, w)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (n + 2) for n in w) + "|", *map(line, rows)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--opt-level", type=int, default=3)
    ap.add_argument("--target-cc", default="8.6")
    args = ap.parse_args()

    from tasks.trt import Backend
    from tasks.graph import onnx_flops
    from tasks.graph import load_onnx
    from tasks.graph import graph_io, resolve_source
    from tasks.data import activation_mib, check_given, propose, read_traffic, serving

    path = resolve_source(SOURCE)
    model = load_onnx(path)
    with tempfile.TemporaryDirectory() as d:
        traffic = read_traffic(document_traffic(Path(d) / "requests.jsonl"), graph_io(model)[0])
    t0 = time.perf_counter()
    proposed = propose(traffic, model)
    propose_s = time.perf_counter() - t0
    backend = Backend("tensorrt_rtx")
    flops: dict[tuple, float] = {}

    def cost(shape: dict) -> float:
        key = tuple(shape["x"])
        if key not in flops:
            flops[key] = sum(onnx_flops(model, {"x": list(shape["x"])}).values())
        return flops[key]

    rows = []
    two = propose(traffic, model, k=2)
    for name, profiles in (("wide (conf/model/ppocr_det.yaml)", WIDE), ("proposed, traffic.profiles=2", two.profiles),
                           ("proposed (K chosen)", proposed.profiles)):
        cov = check_given(traffic, profiles)
        dist, n = 0.0, 0
        for s, c in zip(traffic.shapes, traffic.counts):  # exact FLOPs per request shape (78 unique)
            k = serving(profiles, s)
            if k is not None:
                opt = {"x": tuple(profiles[k]["x"]["opt"])}
                dist += c * abs(cost(s) - cost(opt)) / cost(opt)
                n += c
        act = max(activation_mib(model, {"x": tuple(p["x"]["max"])}) for p in profiles)
        t = time.perf_counter()
        engine = backend.build_engine(str(path), profiles, args.target_cc, optimization_level=args.opt_level)
        build_s = time.perf_counter() - t
        rows.append([name, len(profiles), f"{cov.covered}/{cov.requests} ({cov.coverage:.3%})", f"{act:,.0f}",
                     f"{dist / n:.1%}", f"{len(engine) / 1e6:.1f}", f"{build_s:.1f}"])
    print(f"PP-OCRv4 det, {traffic.requests} requests ({len(traffic.shapes)} shapes), TensorRT-RTX "
          f"{backend.version} for compute capability {args.target_cc}, optimization level {args.opt_level}; "
          f"proposal made in {propose_s:.1f} s\n")
    print(table(["profiles", "K", "requests covered", "activation MiB at max (est.)",
                 "mean FLOPs distance to opt", "engine MB", "build s"], rows))
    print("\n" + proposed.k_reason)
    return 0


if __name__ == "__main__":
    sys.exit(main())
