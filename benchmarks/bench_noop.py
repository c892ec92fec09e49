"""Cold build vs an up-to-date (no-op) build vs a sweep, as users run them (`python -m flows.build` processes).

    .venv/bin/python benchmarks/bench_noop.py [--model ppocr_det] [--target sm_86] [--precision fp16] [--sweep]

1. cold: empty cache, out and MLflow store: every stage runs, Prefect's temporary server starts, MLflow logs.
2. no-op: the same command again, three times (median): the build key is computed (hashes of the model, config,
   data, code, backend version) and compared with the published summary and its MLflow run; nothing else runs.
3. warm cache, no published result (out/ removed): every stage `cached`, but Prefect and MLflow still run.
4. --sweep: `-m target=sm_80,sm_86,sm_89 precision=fp32,fp16` cold vs the six builds one by one (cold each).
Next to them, the floor of a no-op: interpreter start and sha256 of the model and engine files (hashlib).
Everything runs in a fresh temp folder, its cwd; nothing is written into the repository.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_build import pipeline_env as bench_env, python_exe  # noqa: E402  (one temp state, one interpreter)


def run(tmp: Path, args: list[str], label: str) -> tuple[float, str]:
    from flows.local import daemon

    env = bench_env(tmp)
    before = daemon.served(env)
    label += " (warm process)" if daemon.enabled() and daemon.socket_path(daemon.identity(env)).exists() else ""
    print(f"  {label:<50}", end=" ", flush=True)
    t0 = time.perf_counter()
    p = subprocess.run([python_exe(), "-m", "flows.build", *args, f"out_dir={tmp / 'out'}",
                        f"cache_dir={tmp / 'cache'}"], cwd=tmp, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    print(f"{wall:6.2f} s (exit {p.returncode}{', served warm' if daemon.served(env) > before else ''})", flush=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-3000:])
        raise SystemExit(f"bench_noop: {label} failed")
    return wall, p.stdout


def floor(files: list[Path]) -> float:
    t0 = time.perf_counter()
    subprocess.run([python_exe(), "-c", "pass"], check=True)
    for f in files:
        hashlib.sha256(f.read_bytes()).hexdigest()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="ppocr_det")
    ap.add_argument("--target", default="sm_86")
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--sweep", action="store_true", help="also time a 3 targets x 2 precisions sweep")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="trtforge-bench-noop-"))
    print(f"host {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; temp {tmp}")
    args = [f"model={a.model}", f"target={a.target}", f"precision={a.precision}"]
    try:
        cold, _ = run(tmp, args, "cold")
        from flows.local import daemon

        if daemon.enabled():  # the first build left a warm process behind: later builds of a session use it
            waited = daemon.wait_serving(bench_env(tmp))
            print("  " + ("no warm process came up" if waited is None else f"warm process up {waited:.1f} s later"))
        noops = []
        for i in range(3):
            w, out = run(tmp, args, f"no-op #{i + 1}")
            assert "up to date" in out, out
            noops.append(w)
        noop = statistics.median(noops)
        s = json.loads(next((tmp / "out").glob(f"*/{a.target}/{a.precision}/summary.json")).read_text())
        out_dir = next((tmp / "out").glob(f"*/{a.target}/{a.precision}"))
        from tasks.graph import resolve_source
        from flows.config import compose_config
        src = resolve_source(compose_config(args).model.source)
        fl = floor([src] + [out_dir / e["file"] for e in s["engines"]])
        shutil.rmtree(tmp / "out")
        warm, _ = run(tmp, args, "warm cache, result removed")
        rows = [("cold build", cold, 1.0), ("no-op (up to date), median of 3", noop, noop / cold),
                ("warm cache, no published result", warm, warm / cold),
                ("floor: python start + sha256 of model and engines", fl, fl / cold)]
        if a.sweep:
            targets, precs = ("sm_80", "sm_86", "sm_89"), ("fp32", "fp16")
            one_by_one = 0.0
            for t in targets:
                for p in precs:
                    w, _ = run(tmp, [f"model={a.model}", f"target={t}", f"precision={p}", f"cache_dir={tmp / 'c1'}",
                                     f"out_dir={tmp / 'o1'}", f"experiment=one-by-one-{t}-{p}"], f"one by one {t} {p}")
                    one_by_one += w
            sw, _ = run(tmp, ["-m", f"model={a.model}", f"target={','.join(targets)}", f"precision={','.join(precs)}",
                              f"cache_dir={tmp / 'c2'}", f"out_dir={tmp / 'o2'}", "experiment=sweep"], "sweep -m (3x2)")
            rows += [("six builds one by one (cold)", one_by_one, one_by_one / cold),
                     ("sweep -m 3 targets x 2 precisions (cold)", sw, sw / cold)]
        print(f"\n== {a.model} {a.target} {a.precision}: wall time of `python -m flows.build` ==")
        w = max(len(r[0]) for r in rows)
        print(f"{'what':<{w}}  {'seconds':>8}  {'x cold':>7}\n{'-' * w}  {'-' * 8}  {'-' * 7}")
        for name, sec, ratio in rows:
            print(f"{name:<{w}}  {sec:8.2f}  {ratio:7.3f}")
        print("goal: no-op <= 0.1x cold (bar 0.25x)")
    finally:
        from flows.local import daemon, server

        daemon.stop(bench_env(tmp))
        server.shutdown(tmp / "prefect")  # its shared Prefect server goes with the temp folder
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
