"""trtforge vs the raw libraries, for the PP-OCRv4 det model on sm_86.

    .venv/bin/python benchmarks/bench_build.py [--quick] [--keep] [--runs N]

Compares, on the same ONNX file and the same settings:
  1. the pipeline (`python -m flows.build ...` as a subprocess): cold cache, warm cache, and fp16 (cold);
     per-stage seconds come from the summary.json each run writes (summary_out=...);
  2. the raw TensorRT-RTX build (Builder, create_network(0), OnnxParser.parse_from_file, a builder config for
     SM86 only, one optimization profile, build_serialized_network), timed parse and build;
  3. raw ONNX Runtime (InferenceSession, CPUExecutionProvider) at the opt shape 1x3x640x640, p50 over N runs,
     next to the benchmark stage's `ort_p50_ms`.
Then the fixed overheads against their goals (GOALS): process start + imports, the shared local Prefect server
(flows/local/server.py) and the first flow, and MLflow logging, measured by a
probe subprocess, with the remainder (wall time minus stage seconds) split as far as the runs allow.

Everything goes in a fresh temp folder (cache, outputs, MLflow db and artifacts, Prefect home); the
subprocesses run with that folder as their working directory so nothing is written into the repository.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.graph import resolve_source  # noqa: E402  (light: no TensorRT, no ONNX Runtime)
from tasks.common import quiet_native  # noqa: E402

SOURCE = "pkg://rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"
MODEL, TARGET = "ppocr_det", "sm_86"
PROFILE = {"x": {"min": (1, 3, 32, 32), "opt": (1, 3, 640, 640), "max": (4, 3, 1280, 1280)}}  # conf/model/ppocr_det.yaml
OPT_LEVEL = 3  # conf default build.optimization_level
# the goals for the overhead (wall time minus the sum of stage seconds) of a build in its own process, the default
# on existing state (Prefect home, MLflow store, local Prefect server) and a fresh machine's first build
GOALS = {"existing": 3.0, "fresh": 5.0}
ORT_WARMUP = 3  # conf default benchmark.warmup (the pipeline times repeats x iterations = 3 x 10 = 30 runs)
from tasks.schema import STAGES  # noqa: E402


def python_exe() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


# --- 1. the pipeline -----------------------------------------------------------------------------------------

def pipeline_env(tmp: Path) -> dict:
    return dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp / 'mlflow.db'}", PREFECT_HOME=str(tmp / "prefect"),
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def wait_warm(tmp: Path) -> str:
    """After the first build: wait until the warm build process it left behind serves (flows/local/daemon.py), as it does
    for every later build of a session; what the later runs had."""
    from flows.local import daemon

    if not daemon.enabled():
        return "no warm process (TRTFORGE_DAEMON=0)"
    waited = daemon.wait_serving(pipeline_env(tmp))
    return "no warm process came up in 120 s" if waited is None else f"warm process up {waited:.1f} s after the first build"


def run_pipeline(tmp: Path, label: str, precision: str, cache: str) -> dict:
    """One `python -m flows.build` subprocess; returns wall time, the CLI's in-process time and summary.json."""
    summary_path = tmp / f"summary.{label}.json"
    cmd = [python_exe(), "-m", "flows.build", f"model={MODEL}", f"target={TARGET}", f"precision={precision}",
           f"cache_dir={tmp / cache}", f"out_dir={tmp / ('out_' + label)}", f"summary_out={summary_path}"]
    env = pipeline_env(tmp)
    timeline = tmp / f"timeline.{label}.jsonl"
    env["TRTFORGE_TIMELINE"] = str(timeline)  # the run's own phase marks (flows/timeline.py)
    from flows.local import daemon

    served_before = daemon.served(env)
    print(f"  pipeline {label:<10} precision={precision} cache={cache} ...", end=" ", flush=True)
    t0, epoch0 = time.perf_counter(), time.time()
    p = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    print(f"{wall:.1f}s (exit {p.returncode})", flush=True)
    if p.returncode != 0 or not summary_path.is_file():
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-3000:])
        raise SystemExit(f"bench_build: the pipeline run {label!r} failed (exit {p.returncode})")
    m = re.search(r": (?:ok|failed) in ([\d.]+)s", p.stdout)
    summary = json.loads(summary_path.read_text())
    stage_s = sum(float(s.get("seconds") or 0.0) for s in summary["stages"].values())
    marks = dict(json.loads(timeline.read_text().splitlines()[-1])["marks"]) if timeline.is_file() else {}
    return {"label": label, "wall": wall, "in_process": float(m.group(1)) if m else None, "summary": summary,
            "warm": daemon.served(env) > served_before, "marks": marks, "epoch0": epoch0, "epoch1": epoch0 + wall,
            "stage_sum": stage_s, "out_dir": tmp / ("out_" + label) / MODEL / TARGET / precision}


PROBE = r'''
import json, os, sys, time
from pathlib import Path
args = json.loads(sys.argv[1])
out = {}
def lap(key, t):
    out[key] = time.perf_counter() - t
from flows.env import env_defaults; env_defaults()
# the shared server first: Prefect reads PREFECT_API_URL when it is imported (a build imports it after ensure())
t = time.perf_counter(); import flows.local.server; flows.local.server.ensure(); lap("prefect: the shared local server (found, or started)", t)
t = time.perf_counter()
from prefect import flow, task
from prefect.cache_policies import NONE
lap("import prefect", t)
t = time.perf_counter(); import flows.build, flows.stages, flows.cli; lap("import flows (hydra, omegaconf, rich)", t)
t = time.perf_counter(); import tensorrt_rtx_bindings; lap("import tensorrt_rtx_bindings", t)
t = time.perf_counter(); import onnx, onnxruntime; lap("import onnx + onnxruntime", t)
t = time.perf_counter(); import mlflow; lap("import mlflow", t)

@task(cache_policy=NONE, persist_result=False)
def noop(i):
    return i

@flow(persist_result=False)
def trivial():
    for i in range(7):  # 6 stages + track
        noop(i)

with flows.local.server.without_heartbeats():  # as a build runs its flow
    t = time.perf_counter(); trivial(); lap("prefect: 1st flow in the process", t)
    time.sleep(2)  # a build's flows are seconds apart: the server has caught up with the last one's events
    t = time.perf_counter(); trivial(); lap("prefect: 2nd flow, same process (server up)", t)

from omegaconf import OmegaConf
from flows.config import compose_config, flat_params
from flows.tracking import log_build
cfg = compose_config(args["overrides"])
out_dir = Path(args["out_dir"])
summary = json.loads((out_dir / "summary.json").read_text())
kw = dict(experiment=cfg.experiment, summary=summary, params=flat_params(cfg), resolved_yaml=OmegaConf.to_yaml(cfg),
          out_dir=out_dir, engine_files=[out_dir / e["file"] for e in summary["engines"]], versions=summary["versions"],
          provenance={})
import uuid
from flows.tracking import end_run
t = time.perf_counter(); end_run(log_build(build_id=uuid.uuid4().hex, **kw)["run_id"], ok=True); lap("mlflow: 1st log_build in the process", t)
t = time.perf_counter(); end_run(log_build(build_id=uuid.uuid4().hex, **kw)["run_id"], ok=True); lap("mlflow: 2nd log_build", t)
print("PROBE_JSON " + json.dumps(out))
'''


def run_probe(tmp: Path, cold: dict, state: str) -> dict:
    """Imports, a trivial Prefect flow and MLflow's log_build, timed in a fresh process.

    state "fresh": new PREFECT_HOME and MLflow db (like the cold fp32 run); "existing": the same ones again
    (like the warm and fp16 runs, which reuse the home and db the cold run created)."""
    d = tmp / "probe"
    d.mkdir(exist_ok=True)
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{d / 'mlflow.db'}", PREFECT_HOME=str(d / "prefect"),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = {"overrides": [f"model={MODEL}", f"target={TARGET}", "precision=fp32"], "out_dir": str(cold["out_dir"])}
    print(f"  probe ({state} Prefect home + MLflow db): imports, Prefect, MLflow ...", end=" ", flush=True)
    t0 = time.perf_counter()
    p = subprocess.run([python_exe(), "-c", PROBE, json.dumps(args)], cwd=d, env=env, capture_output=True, text=True)
    print(f"{time.perf_counter() - t0:.1f}s", flush=True)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("PROBE_JSON ")), None)
    if line is None:
        sys.stderr.write(p.stdout[-2000:] + p.stderr[-2000:])
        return {}
    out = json.loads(line[len("PROBE_JSON "):])
    t0 = time.perf_counter()
    subprocess.run([python_exe(), "-c", "pass"], check=True)
    out["interpreter start (python -c pass)"] = time.perf_counter() - t0
    return out


# --- 2. raw TensorRT-RTX -------------------------------------------------------------------------------------

def raw_trt_build(trt, onnx_path: Path) -> dict:
    """The project's build, written out with the TensorRT API; native fd chatter (cudaError 35) is captured."""
    r: dict = {}
    with quiet_native():
        t = time.perf_counter()
        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, logger)
        r["setup"] = time.perf_counter() - t

        t = time.perf_counter()
        parsed = parser.parse_from_file(str(onnx_path))
        r["parse"] = time.perf_counter() - t
        errors = [parser.get_error(i).desc() for i in range(parser.num_errors)]

        serialized = None
        if parsed:
            config = builder.create_builder_config()
            config.num_compute_capabilities = 1
            config.set_compute_capability(trt.ComputeCapability.SM86, 0)
            config.builder_optimization_level = OPT_LEVEL
            profile = builder.create_optimization_profile()
            for name, s in PROFILE.items():
                profile.set_shape(name, s["min"], s["opt"], s["max"])
            config.add_optimization_profile(profile)
            t = time.perf_counter()
            serialized = builder.build_serialized_network(network, config)
            r["build"] = time.perf_counter() - t
    if not parsed:
        raise SystemExit(f"bench_build: the TensorRT-RTX parser rejected {onnx_path}: {errors[:3]}")
    if serialized is None or serialized.nbytes == 0:
        raise SystemExit(f"bench_build: build_serialized_network returned nothing for {onnx_path}")
    r["bytes"] = serialized.nbytes
    r["parse+build"] = r["parse"] + r["build"]
    return r


# --- 3. raw ONNX Runtime -------------------------------------------------------------------------------------

def raw_ort(onnx_path: Path, runs: int) -> dict:
    import numpy as np

    r: dict = {}
    t = time.perf_counter()
    import onnxruntime as ort
    r["import"] = time.perf_counter() - t
    t = time.perf_counter()
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    r["session_create_ms"] = (time.perf_counter() - t) * 1e3
    name = sess.get_inputs()[0].name
    # an image-like tensor (normalized noise); CPU conv latency does not depend on the pixel values
    x = np.random.default_rng(0).standard_normal((1, 3, 640, 640)).astype(np.float32)
    for _ in range(ORT_WARMUP):
        sess.run(None, {name: x})
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        sess.run(None, {name: x})
        times.append((time.perf_counter() - t) * 1e3)
    r["p50_ms"] = float(np.percentile(times, 50))
    r["runs"] = runs
    return r


# --- output --------------------------------------------------------------------------------------------------

def table(headers: list[str], rows: list[list[str]]) -> str:
    w = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    fmt = lambda row: "  ".join(str(c).ljust(w[0]) if i == 0 else str(c).rjust(w[i]) for i, c in enumerate(row))  # noqa: E731
    return "\n".join([fmt(headers), "  ".join("-" * n for n in w)] + [fmt(r) for r in rows])


def s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.1f}x"


def stage_cell(run: dict, name: str) -> str:
    st = run["summary"]["stages"].get(name, {})
    return f"{st.get('status', '-')} {float(st.get('seconds') or 0):.2f}"


PHASES = (("start", "start"), ("to_server", "to server"), ("flow_run", "flow run"), ("between", "between"),
          ("track", "track"), ("publish", "publish"), ("exit", "exit"))


def phases(run: dict) -> dict:
    """Seconds of each phase around the stages, from the marks the run wrote (epoch seconds)."""
    m, out = run["marks"], {}
    if not m:
        return out
    span = lambda a, b: (m[b] - m[a]) if a in m and b in m else None  # noqa: E731
    out["start"] = m["command started"] - run["epoch0"] if "command started" in m else None
    out["to_server"] = span("command started", "prefect server answers")
    out["flow_run"] = span("prefect server answers", "flow run started")
    flow = span("flow run started", "stages done")
    out["between"] = None if flow is None else flow - run["stage_sum"]
    out["track"] = span("stages done", "tracked")
    out["publish"] = span("tracked", "run ended")
    out["exit"] = run["epoch1"] - m["run ended"] if "run ended" in m else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer raw ONNX Runtime runs (10 instead of 30)")
    ap.add_argument("--runs", type=int, default=None, help="raw ONNX Runtime timed runs (default 30, --quick 10)")
    ap.add_argument("--keep", action="store_true", help="keep the temp folder (cache, outputs, MLflow db) and print it")
    args = ap.parse_args()
    runs = args.runs or (10 if args.quick else 30)

    onnx_path = resolve_source(SOURCE)
    tmp = Path(tempfile.mkdtemp(prefix="trtforge-bench-"))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"host   {os.cpu_count()} CPUs, load average {load} (other work on the host skews the timings)")
    print(f"model  {onnx_path}\ntarget {TARGET}, profile x: min {PROFILE['x']['min']} opt {PROFILE['x']['opt']} "
          f"max {PROFILE['x']['max']}, optimization level {OPT_LEVEL}\ntemp   {tmp}\n")
    try:
        cold = run_pipeline(tmp, "fp32-cold", "fp32", "cache_fp32")
        print(f"  {wait_warm(tmp)}")
        warm = run_pipeline(tmp, "fp32-warm", "fp32", "cache_fp32")
        fp16 = run_pipeline(tmp, "fp16-cold", "fp16", "cache_fp16")
        probes = {"fresh": run_probe(tmp, cold, "fresh"), "existing": run_probe(tmp, cold, "existing")}
        probe = probes["fresh"]

        print("  raw TensorRT-RTX build (fp32 ONNX) ...", end=" ", flush=True)
        t = time.perf_counter()
        import tensorrt_rtx_bindings as trt
        trt_import = time.perf_counter() - t
        raw32 = raw_trt_build(trt, onnx_path)
        print(f"{raw32['parse+build']:.1f}s", flush=True)
        # the fp16 graph the build stage converted (one file per TensorRT segment; PP-OCR det is one segment)
        fp16_files = sorted((tmp / "cache_fp16" / "build").glob("*/*.onnx"))
        fp16_onnx = fp16_files[0] if len(fp16_files) == 1 else None
        raw16 = None
        if fp16_onnx is None:
            print(f"  (no raw fp16 build: expected one converted ONNX in the fp16 build cache, found {len(fp16_files)})")
        else:
            print("  raw TensorRT-RTX build (the pipeline's fp16 ONNX) ...", end=" ", flush=True)
            raw16 = raw_trt_build(trt, fp16_onnx)
            print(f"{raw16['parse+build']:.1f}s", flush=True)
        print(f"  raw ONNX Runtime, {runs} runs ...", end=" ", flush=True)
        ort_r = raw_ort(onnx_path, runs)
        print(f"p50 {ort_r['p50_ms']:.1f} ms\n", flush=True)

        py_start = probe.get("interpreter start (python -c pass)", 0.0)
        raw_e2e32 = py_start + trt_import + raw32["setup"] + raw32["parse+build"]
        raw_e2e16 = py_start + trt_import + raw16["setup"] + raw16["parse+build"] if raw16 else None
        cm, fm = cold["summary"]["metrics"], fp16["summary"]["metrics"]
        stage_s = lambda run, n: float(run["summary"]["stages"].get(n, {}).get("seconds") or 0)  # noqa: E731

        print("== trtforge vs raw library (same ONNX, same profile, sm_86, optimization level 3) ==")
        rows = [
            ["fp32 engine: build stage vs parse+build", s(stage_s(cold, "build")), s(raw32["parse+build"]),
             ratio(stage_s(cold, "build"), raw32["parse+build"])],
            ["  of which TensorRT (build_seconds metric)", s(cm.get("build_seconds")), s(raw32["parse+build"]),
             ratio(cm.get("build_seconds"), raw32["parse+build"])],
            ["fp32 ONNX -> engine, wall, cold cache", s(cold["wall"]), s(raw_e2e32), ratio(cold["wall"], raw_e2e32)],
            ["fp32 ONNX -> engine, wall, warm cache", s(warm["wall"]), s(raw_e2e32), ratio(warm["wall"], raw_e2e32)],
        ]
        if raw16:
            rows += [
                ["fp16 engine: build stage vs parse+build", s(stage_s(fp16, "build")), s(raw16["parse+build"]),
                 ratio(stage_s(fp16, "build"), raw16["parse+build"])],
                ["fp16 ONNX -> engine, wall, cold cache", s(fp16["wall"]), s(raw_e2e16), ratio(fp16["wall"], raw_e2e16)],
            ]
        rows += [
            ["ORT CPU session create, fp32 ONNX", ms(cm.get("ort_session_create_ms")), ms(ort_r["session_create_ms"]),
             ratio(cm.get("ort_session_create_ms"), ort_r["session_create_ms"])],
            [f"ORT CPU p50 at 1x3x640x640 (raw: {runs} runs)", ms(cm.get("ort_p50_ms")), ms(ort_r["p50_ms"]),
             ratio(cm.get("ort_p50_ms"), ort_r["p50_ms"])],
        ]
        print(table(["what", "trtforge", "raw library", "ratio"], rows))
        print(f"raw TensorRT-RTX detail: import {trt_import:.2f} s, builder+network+parser {raw32['setup']:.2f} s, "
              f"parse {raw32['parse']:.2f} s, build {raw32['build']:.2f} s, engine {raw32['bytes'] / 1e6:.1f} MB "
              f"(trtforge engine {cm.get('engine_bytes', 0) / 1e6:.1f} MB)")
        if raw16:
            print(f"raw fp16 detail: parse {raw16['parse']:.2f} s, build {raw16['build']:.2f} s, engine "
                  f"{raw16['bytes'] / 1e6:.1f} MB (trtforge {fm.get('engine_bytes', 0) / 1e6:.1f} MB); fp16 graph "
                  f"conversion inside the build stage: {fm.get('convert_seconds', 0):.2f} s")
        print("raw wall = interpreter start + import + parse + build (in this process); the pipeline also validates "
              "and benchmarks, so its wall rows are not like for like: see the breakdown below.\n")

        print("== per-stage seconds (summary.json) ==")
        runs_ = [cold, warm, fp16]
        srows = [[n] + [stage_cell(r, n) for r in runs_] for n in STAGES]
        srows.append(["sum of stages"] + [f"{r['stage_sum']:.2f}" for r in runs_])
        srows.append(["in-process (CLI 'ok in')"] + [f"{r['in_process']:.2f}" if r["in_process"] else "-" for r in runs_])
        srows.append(["wall (subprocess)"] + [f"{r['wall']:.2f}" for r in runs_])
        print(table(["stage", "fp32 cold", "fp32 warm", "fp16 cold"], srows))
        print()

        print("== fixed overheads (wall minus stage seconds), split by the run's own marks (TRTFORGE_TIMELINE) ==")
        orows = []
        for r, state in ((cold, "fresh"), (warm, "existing"), (fp16, "existing")):
            over, goal = r["wall"] - r["stage_sum"], GOALS[state]
            ph = phases(r)
            orows.append([f"{r['label']} ({state} state{', warm process' if r['warm'] else ''})", f"{over:.2f}",
                          f"<= {goal:.0f}", "met" if over <= goal else f"not met (+{over - goal:.1f} s)"]
                         + [("-" if ph.get(k) is None else f"{ph[k]:.2f}") for k, _ in PHASES])
        print(table(["run", "wall - stages", "goal", ""] + [h for _, h in PHASES], orows))
        print("start = process start to the command's start (interpreter, the warm-process check, imports; a run served "
              "by the warm process\n  pays neither); to server = config, up-to-date check, preflight and the wait for "
              "the shared Prefect server (its start\n  runs beside them); flow run = Prefect creating the flow run; "
              "between = in the flow, outside the stages; track = report,\n  versions, MLflow run and registry; publish = "
              "the result made current and the run ended; exit = summary printed, process gone.\n"
              "The probes below time the same pieces one after another in a fresh process (nothing overlapped).")
        print()
        for state, pr in probes.items():
            if pr:
                print(f"probe process, {state} PREFECT_HOME and MLflow db:")
                print(table(["what", "seconds"], [[k, f"{v:.2f}"] for k, v in pr.items()]))
                print()
    finally:
        from flows.local import daemon, server

        daemon.stop(pipeline_env(tmp))  # its warm process exits
        for home in (tmp / "prefect", tmp / "probe" / "prefect"):  # and the shared servers of its Prefect homes
            server.shutdown(home)
        if args.keep:
            print(f"\nkept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
