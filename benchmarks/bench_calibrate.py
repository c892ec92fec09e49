"""Calibrate stage vs the raw ONNX Runtime quantization call, PP-OCRv4 det, same data and settings.

trtforge's calibrate computes ranges once (entropy: its own vectorised KL search over a 2048-bin histogram) and writes
a Q/DQ graph on Conv/MatMul/Gemm inputs (symmetric, per-channel weights, bias in float). The raw call is
onnxruntime.quantization.quantize_static with the same samples, op types and options on the same prepared graph
(opset 13, constants folded). Rows: every layer quantized (no accuracy search), per method; the budget search is
timed separately (the raw library has no equivalent).

Second table, ranges vs ModelOpt (nvidia-modelopt 0.47.0, `modelopt.onnx.quantization.quantize`, int8, CPU
calibration): the same prepared graph and the same samples, one per calibration step. For each method pair the
activation amax each tool wrote into its graph (amax = QuantizeLinear scale * 127, symmetric int8, the tensor read
through any Cast) is compared per tensor, and each tool's full-int8 graph (ours: every Conv/MatMul/Gemm plus residual
Add inputs; ModelOpt: its default TensorRT placement) is scored by cosine to fp32 on held-out pages. ModelOpt runs in
a child process: it patches ONNX Runtime's calibrators in the process that imports it.

    .venv/bin/python benchmarks/bench_calibrate.py [--samples 8] [--size 640] [--quick] [--no-modelopt]
    .venv/bin/python benchmarks/bench_calibrate.py --stage det24,det_v5   # the calibrate stage as a user runs it

``--stage``: the calibrate stage as users run it, through the CLI (`python -m flows.build`, int8, sm_86,
accuracy.min_cosine=0.99, the benchmark stage off), on 24 rendered text pages given as `calibration.data` alone (a folder
of .npz files: the build splits them into calibration, the search's held-out set and validation). Cases: `det24`
(PP-OCRv4 det, conf/model/ppocr_det) and `det_v5` (PP-OCRv5 mobile det, benchmarks/zoo/model/ppocr_det_v5.yaml; needs
`benchmarks/zoo.py --install`). Prints the calibrate stage's seconds, the CLI run's CPU seconds, the search's whole-model
runs, the search's figure against validation's, the int8 FLOPs share and the precision boundaries, then the stage's
seconds by step, and the host's speed before and after the cases (a plain run of det: this shared host's speed drifts
by up to a quarter within an hour). Single runs on a shared host: indicative only.
    .venv/bin/pip install --no-deps -r benchmarks/modelopt-requirements.txt   # for the ModelOpt table
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib.util
import io
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.quantization import ranges as ranges_mod  # noqa: E402
from tasks.quantization import qdq_from_onnx  # noqa: E402
from tasks.sources import onnx_from_model  # noqa: E402
from tasks.data import preprocess, render_text_image  # noqa: E402
from tasks.graph import resolve_source  # noqa: E402

MODELOPT_INSTALL = ".venv/bin/pip install --no-deps -r benchmarks/modelopt-requirements.txt"
# (ours, ModelOpt's name for it or None, ModelOpt's name of the method it is compared with)
MODELOPT_PAIRS = (("entropy", "entropy"), ("minmax", "max"), ("percentile", "max"))
DET = "pkg://rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"
RECIPE = {"channel_order": "BGR", "scale": 1 / 255, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
          "layout": "NCHW"}


class Reader:
    """CalibrationDataReader over the same feeds, one sample per call."""

    def __init__(self, feeds):
        self.feeds = list(feeds)

    def get_next(self):
        return self.feeds.pop(0) if self.feeds else None


def raw_quantize_static(prepared: Path, out: Path, feeds, method: str, bins: int | None) -> float:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    cm = {"entropy": CalibrationMethod.Entropy, "minmax": CalibrationMethod.MinMax,
          "percentile": CalibrationMethod.Percentile}[method]
    extra = {"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False}
    if bins and method != "minmax":
        extra["CalibNumBins"] = bins
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        quantize_static(str(prepared), str(out), Reader(feeds), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=["Conv", "MatMul", "Gemm"], per_channel=True,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, calibrate_method=cm,
                        extra_options=extra)
    return time.perf_counter() - t0


def cosine(a: Path, b: Path, feeds) -> float:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    sa = ort.InferenceSession(str(a), so, providers=["CPUExecutionProvider"])
    sb = ort.InferenceSession(str(b), so, providers=["CPUExecutionProvider"])
    worst = 1.0
    for f in feeds:
        x, y = sa.run(None, f)[0].ravel().astype(np.float64), sb.run(None, f)[0].ravel().astype(np.float64)
        worst = min(worst, float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y))))
    return worst


def modelopt_quantize(prepared: str, out: str, data: str, shape: str, method: str, high_precision: str) -> float:
    """In a child process: ModelOpt's int8 ONNX PTQ with calibration on ONNX Runtime's CPU provider; its seconds."""
    import logging

    import numpy as np
    from modelopt.onnx.quantization import quantize

    logging.disable(logging.ERROR)  # "Failed to get GPU count: NVML Shared Library Not Found" on a host without a GPU
    calib = np.load(data)["x"]
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        quantize(prepared, quantize_mode="int8", calibration_data=calib, calibration_shapes=shape,
                 calibration_method=method, calibration_eps=["cpu"], high_precision_dtype=high_precision,
                 output_path=out, log_level="ERROR")
    return time.perf_counter() - t0


def activation_amax(path: Path) -> dict[str, float]:
    """{activation tensor: amax} from a Q/DQ graph's activation QuantizeLinear nodes (amax = scale * 127, symmetric
    int8); a tensor reached through Cast nodes (the fp16 graphs' input casts) is named by the tensor before them."""
    import onnx
    from onnx import numpy_helper

    g = onnx.load(str(path)).graph
    values = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    values |= {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in g.node if n.op_type == "Constant"}
    casts = {n.output[0]: n.input[0] for n in g.node if n.op_type == "Cast"}
    out = {}
    for n in g.node:
        if n.op_type == "QuantizeLinear" and n.input[0] not in values:
            name = n.input[0]
            while name in casts:
                name = casts[name]
            out.setdefault(name, float(np.asarray(values[n.input[1]], np.float64).max()) * 127.0)
    return out


def compare_ranges(ours: dict[str, float], theirs: dict[str, float]) -> dict:
    common = sorted(set(ours) & set(theirs))
    r = np.array([ours[k] / theirs[k] for k in common])
    worst = sorted(common, key=lambda k: -abs(np.log(ours[k] / theirs[k])))[:5]
    return {"ours": len(ours), "theirs": len(theirs), "common": len(common), "median": float(np.median(r)),
            "min": float(r.min()), "max": float(r.max()), "within1": int((abs(r - 1) <= 0.01).sum()),
            "within10": int((abs(r - 1) <= 0.10).sum()), "worst": [(k, ours[k], theirs[k]) for k in worst]}


def modelopt_table(fp32: Path, feeds, held, tmp: Path, quick: bool, budget: Path | None) -> None:
    """Our ranges and full-int8 graphs next to ModelOpt's on the same prepared graph and samples (printed)."""
    np.savez(tmp / "calib.npz", x=np.concatenate([f["x"] for f in feeds]))
    shape = "x:" + "x".join(str(d) for d in feeds[0]["x"].shape)
    ours, theirs = {}, {}
    for method in dict.fromkeys(m for m, _ in MODELOPT_PAIRS):
        ranges_mod._RANGES_MEMO.clear()  # time a fresh calibration, not the ranges memo of the first table
        r = qdq_from_onnx(fp32, feeds, tmp / f"ours_fp32_{method}.onnx", method=method, eval_feeds=held,
                          workdir=tmp / f"mo_work_{method}", high_precision="fp32")
        ours[method] = {"path": r.files["onnx"], "seconds": r.metrics["calibrate_seconds"],
                        "cosine": r.metrics["search_cosine_all_quantized"]}
    prepared = r.files["fp32_prepared"]
    runs = [(m, "fp32") for m in dict.fromkeys(m for _, m in MODELOPT_PAIRS)] + ([] if quick else [("entropy", "fp16")])
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: ModelOpt patches ORT's calibrators on import
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        for method, hp in runs:
            out = tmp / f"modelopt_{method}_{hp}.onnx"
            try:
                secs = pool.submit(modelopt_quantize, str(prepared), str(out), str(tmp / "calib.npz"), shape, method,
                                   hp).result()
                theirs[(method, hp)] = {"path": out, "seconds": secs, "cosine": cosine(prepared, out, held)}
            except Exception as e:  # noqa: BLE001 - reported, not hidden
                theirs[(method, hp)] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
    print(f"\nranges vs ModelOpt {_version('nvidia-modelopt')} (int8 ONNX PTQ, calibration_eps=['cpu']), "
          f"same prepared graph, same {len(feeds)} samples at {shape}, cosine to fp32 (ORT CPU) on {len(held)} "
          f"held-out pages, Q/DQ graphs with the rest in fp32:")
    for m, hp in runs:
        if "error" in theirs[(m, hp)]:
            print(f"  ModelOpt {m} ({hp}) FAILED on this host: {theirs[(m, hp)]['error']}")
    print(f"{'ours vs ModelOpt':<32} {'tensors':>15} {'median':>7} {'min':>6} {'max':>6} {'<=1%':>5} {'<=10%':>6} "
          f"{'cos ours':>9} {'cos MO':>8} {'s ours':>7} {'s MO':>6}")
    rows = [(f"{om} vs {mm}" + (" (MO has none)" if om == "percentile" else ""), ours[om], theirs[(mm, "fp32")])
            for om, mm in MODELOPT_PAIRS]
    rows.append(("MO entropy vs MO max (MO's own)", theirs[("entropy", "fp32")], theirs[("max", "fp32")]))
    worst = []
    for label, a, b in rows:
        if "error" in a or "error" in b:
            continue
        c = compare_ranges(activation_amax(a["path"]), activation_amax(b["path"]))
        worst.append((label, c))
        print(f"{label:<32} {c['common']:>3} of {c['ours']:>3}/{c['theirs']:<3} {c['median']:>7.3f} {c['min']:>6.3f} "
              f"{c['max']:>6.3f} {c['within1']:>5} {c['within10']:>6} {a['cosine']:>9.4f} {b['cosine']:>8.4f} "
              f"{a['seconds']:>7.1f} {b['seconds']:>6.1f}")
    for label, c in worst:
        if c["within1"] == c["common"]:
            print(f"  {label}: all {c['common']} within 1%")
            continue
        print(f"  {label}, the 5 largest differences (amax left, right, ratio):")
        for k, a, b in c["worst"]:
            print(f"    {k:<40} {a:>10.4g} {b:>10.4g}  {a / b:>6.3f}x")
    t = theirs[("entropy", "fp32")]
    if budget is not None and "error" not in t:
        c = compare_ranges(activation_amax(budget), activation_amax(t["path"]))
        print(f"  our default (accuracy budget 0.99, ranges chosen per tensor, int8 layers only) vs ModelOpt entropy: "
              f"{c['common']} tensors, median {c['median']:.3f}, min {c['min']:.3f}, max {c['max']:.3f}, "
              f"{c['within1']} within 1%, {c['within10']} within 10%")
    t = theirs.get(("entropy", "fp16"))
    if t and "error" not in t:
        print(f"  each tool's default remainder in fp16 (ours: high_precision=fp16, ModelOpt: high_precision_dtype=fp16), "
              f"entropy: ModelOpt cosine {t['cosine']:.4f} in {t['seconds']:.1f} s (ours in the first table)")
    print("  tensors: compared of left/right's activation Q; ratio = left amax / right's; ModelOpt int8 has no "
          "percentile calibrator (any calibration_method other than 'entropy' is MinMax); s = seconds of the whole "
          "quantization call (ours: prepare + calibrate + Q/DQ + accuracy check)")


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


STAGE_CASES = {"det24": [], "det_v5": ["--config-dir", "benchmarks/zoo"]}  # extra CLI arguments per case
STAGE_MODELS = {"det24": "ppocr_det", "det_v5": "ppocr_det_v5"}


def stage_case(case: str, pages: int, size: int, tmp: Path) -> dict:
    """One ``--stage`` case: the build's summary.json, with the wall time of the whole CLI run."""
    import json
    import subprocess

    root = Path(__file__).resolve().parents[1]
    data = tmp / f"pages_{pages}_{size}"
    if not data.is_dir():
        data.mkdir(parents=True)
        rng = np.random.default_rng(0)
        for i in range(pages):
            np.savez(data / f"page{i:02d}.npz", x=preprocess([render_text_image(size, size, rng)], RECIPE))
    run = tmp / case
    cmd = [sys.executable, "-m", "flows.build", *STAGE_CASES[case], f"model={STAGE_MODELS[case]}", "precision=int8",
           "target=sm_86", "accuracy.min_cosine=0.99", f"calibration.data={data}", "stages.benchmark=false",
           f"cache_dir={run / 'cache'}", f"out_dir={run / 'out'}", f"summary_out={run / 'summary.json'}"]
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{run / 'mlflow.db'}", PREFECT_HOME=str(run / "prefect"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true")
    run.mkdir(parents=True, exist_ok=True)
    t0, cpu0 = time.perf_counter(), _children_cpu()
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    finally:  # the run's warm build process and Prefect server (its own PREFECT_HOME) go with it: left idling, each
        # polled at ~3% of a core through the next cases' timings
        from flows.local import daemon, server

        daemon.stop(env)
        server.shutdown(run / "prefect")
    if not (run / "summary.json").is_file():
        raise SystemExit(f"{case}: no summary (exit {proc.returncode}): {proc.stderr[-1500:]}")
    timing: dict = {}  # the search's seconds per step, from the calibrate stage's cached result (not in summary.json)
    for result in (run / "cache" / "calibrate-qdq").glob("*/result.json"):
        for seg in json.loads(result.read_text()).get("details", {}).get("segments", []):
            for k, v in (seg.get("search_timing") or {}).items():
                timing[k] = timing.get(k, 0.0) + v
    return {**json.loads((run / "summary.json").read_text()), "wall": wall, "timing": timing,
            "cpu": _children_cpu() - cpu0}


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children: the CLI run's, all its threads."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def host_speed_ms(runs: int = 10) -> float:
    """The host's speed now: the median milliseconds of a plain run of PP-OCRv4 det (fp32, ONNX Runtime's full
    optimizations, one thread, one 640x640 page). The same stage code took 28.8 s in one hour of this shared host and
    36 s in another (docs/performance.md): the stage's seconds are read against it."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = 1, 3
    sess = ort.InferenceSession(str(resolve_source(DET)), so, providers=["CPUExecutionProvider"])
    x = {sess.get_inputs()[0].name: np.random.default_rng(0).random((1, 3, 640, 640), dtype=np.float32)}
    sess.run(None, x)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, x)
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def stage_table(cases: list[str], pages: int, size: int) -> None:
    speed = host_speed_ms()
    print(f"the calibrate stage as users run it: {pages} text pages of {size}x{size} as calibration.data alone, "
          f"min_cosine 0.99, sm_86; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} (shared host: indicative); "
          f"host speed {speed:.0f} ms (PP-OCRv4 det fp32, one thread, 640x640, median of 10)")
    print(f"{'case':<8} {'status':<7} {'cal s':>6} {'wall s':>7} {'CPU s':>6} {'runs':>5} {'sets':>9} {'margin':>7} "
          f"{'search':>8} {'valid.':>8} {'int8 FLOPs':>10} {'conv int8':>9} {'reformats':>9}")
    steps = []
    with tempfile.TemporaryDirectory(prefix="trtforge-bench-stage-") as tmp:
        for case in cases:
            s = stage_case(case, pages, size, Path(tmp))
            m, d = s.get("metrics", {}), s.get("data", {})
            sets = "/".join(str((d.get(k) or {}).get("samples", "-")) for k in ("calibration", "search", "validation"))

            def f(k, spec):
                return format(m[k], spec) if isinstance(m.get(k), (int, float)) else "-"
            share = m.get("flops_share", {}).get("int8")
            cal = s['stages'].get('calibrate', {}).get('seconds', 0)
            steps.append(f"{case}: " + ", ".join(f"{k} {v:.1f}" for k, v in s["timing"].items())
                         + f", the rest of the stage {cal - sum(s['timing'].values()):.1f} (data, fp32 references, "
                           f"graph preparation, ranges, fp16 range checks, engine build, report)")
            print(f"{case:<8} {s['status']:<7} {cal:>6.1f} "
                  f"{s['wall']:>7.1f} {s['cpu']:>6.1f} {f('search_runs', 'd'):>5} {sets:>9} {f('search_margin', '.3f'):>7} "
                  f"{f('search_cosine', '.5f'):>8} {f('cosine_min', '.5f'):>8} "
                  f"{'-' if share is None else format(share, '.1%'):>10} {f('conv_int8_share', '.1%'):>9} "
                  f"{f('reformat_layers', 'd'):>9}")
    print("the calibrate stage's seconds by step (the search's own timing, details.search_timing: ranges_chosen = each "
          "tensor's range by its layer's local error on 8 calibration pages; ranking = every layer quantized judged "
          "with each set of ranges, the layers ranked; search = the restore search's judgements, its screen and the "
          "boundary step; written_graph = the written graph checked against the search's session):")
    for line in steps:
        print("  " + line)
    print("  CPU s: the whole CLI run's CPU seconds, every thread (on 2 cores, about twice a quiet host's wall time "
          "where both are busy); runs: whole-model runs of one sample in the accuracy search")
    print(f"host speed after the cases: {host_speed_ms():.0f} ms (before: {speed:.0f})")


def main() -> int:
    import logging

    logging.getLogger().setLevel(logging.ERROR)  # ORT's "consider pre-processing" warnings
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--size", type=int, default=640)
    ap.add_argument("--held", type=int, default=2, help="held-out pages judging the search and the cosines")
    ap.add_argument("--quick", action="store_true", help="skip ORT's 2048-bin entropy (about 90 s), the budget search "
                    "and ModelOpt's fp16 run")
    ap.add_argument("--no-modelopt", action="store_true", help="skip the ranges vs ModelOpt table")
    ap.add_argument("--stage", help=f"comma list of {', '.join(STAGE_CASES)}: the calibrate stage through the CLI on "
                    "--pages rendered pages as calibration.data alone (instead of the tables above)")
    ap.add_argument("--pages", type=int, default=24, help="--stage: pages given as calibration.data")
    args = ap.parse_args()
    if args.stage:
        unknown = [c for c in args.stage.split(",") if c not in STAGE_CASES]
        if unknown:
            ap.error(f"--stage: unknown case(s) {', '.join(unknown)}; known: {', '.join(STAGE_CASES)}")
        stage_table(args.stage.split(","), args.pages, args.size)
        return 0
    rng = np.random.default_rng(0)
    feeds = [{"x": preprocess([render_text_image(args.size, args.size, rng)], RECIPE)} for _ in range(args.samples)]
    held = [{"x": preprocess([render_text_image(args.size, args.size, rng)], RECIPE)} for _ in range(args.held)]
    with tempfile.TemporaryDirectory(prefix="trtforge-bench-cal-") as tmp:
        tmp = Path(tmp)
        fp32 = onnx_from_model({"format": "onnx", "source": DET}, [], tmp / "det.onnx").files["onnx"]
        rows = []
        prepared = None
        for method in ("entropy", "minmax", "percentile"):
            t0 = time.perf_counter()
            r = qdq_from_onnx(fp32, feeds, tmp / f"ours_{method}.onnx", method=method, min_cosine=None,
                              eval_feeds=held, workdir=tmp / f"work_{method}")
            ours = time.perf_counter() - t0
            prepared = r.files["fp32_prepared"]
            cal = r.metrics["calibration_seconds"]
            ours_cos = r.metrics["search_cosine_all_quantized"]
            raw = raw_quantize_static(prepared, tmp / f"raw_{method}.onnx", feeds, method, None)
            raw_cos = cosine(prepared, tmp / f"raw_{method}.onnx", held)
            rows.append((f"{method}: trtforge qdq_from_onnx vs quantize_static (ORT default bins)", ours, raw, ours_cos, raw_cos))
            if method == "entropy" and not args.quick:
                raw2 = raw_quantize_static(prepared, tmp / "raw_entropy2048.onnx", feeds, method, 2048)
                rows.append(("entropy, 2048 bins on both (the same setting)", ours, raw2, ours_cos,
                             cosine(prepared, tmp / "raw_entropy2048.onnx", held)))
            rows.append(("  of which trtforge calibration (ranges only)", cal, None, None, None))
        search = None
        if not args.quick:
            t0 = time.perf_counter()
            r = qdq_from_onnx(fp32, feeds, tmp / "budget.onnx", min_cosine=0.99, eval_feeds=held,
                              workdir=tmp / "work_budget")
            choice = r.details["range_choice"]
            search = (time.perf_counter() - t0, r.metrics["quantized_layers"], r.metrics["search_cosine_worst_feed"],
                      {m: list(choice.values()).count(m) for m in sorted(set(choice.values()))}, r.files["onnx"],
                      r.metrics["quantized_layers"] + r.metrics["fallback_layers"], r.metrics["search_runs"],
                      {k: round(v, 1) for k, v in r.details["search_timing"].items()}, r.metrics["calibration_seconds"])
        print(f"PP-OCRv4 det, {args.samples} text-image samples at 1x3x{args.size}x{args.size}, {args.held} held-out for cosine, "
              f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
        print(f"{'what':<70} {'trtforge s':>10} {'raw s':>8} {'ratio':>6} {'cos ours':>9} {'cos raw':>8}")
        for what, ours, raw, c1, c2 in rows:
            cells = [f"{ours:>10.2f}", f"{raw:>8.2f}" if raw else f"{'':>8}", f"{ours / raw:>5.2f}x" if raw else f"{'':>6}",
                     f"{c1:>9.4f}" if c1 is not None else f"{'':>9}", f"{c2:>8.4f}" if c2 is not None else f"{'':>8}"]
            print(f"{what:<70} " + " ".join(cells))
        if search:
            print(f"accuracy budget 0.99, default ranges (entropy, percentile/amax where that loses less locally; restore "
                  f"search, no raw equivalent): {search[0]:.1f} s total (ranges {search[8]:.1f} s, then {search[7]}; "
                  f"{search[6]} whole-model runs of one sample), {search[1]}/{search[5]} layers int8, cosine "
                  f"{search[2]:.4f}, ranges switched {search[3] or 'none'}")
        print("trtforge's time includes preparing the graph (opset 13, constant folding) and its accuracy check; "
              "ORT's default entropy (128 bins) has one candidate range, i.e. it is min/max.")
        if args.no_modelopt:
            pass
        elif importlib.util.find_spec("modelopt") is None:
            print(f"\nranges vs ModelOpt: skipped, nvidia-modelopt is not installed (not a trtforge dependency). "
                  f"Install it with:\n    {MODELOPT_INSTALL}")
        else:
            modelopt_table(fp32, feeds, held, tmp, args.quick, search[4] if search else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
