"""The build farm on Prefect: one process work pool per backend and architecture, one worker per host.

    python -m flows.farm setup [source=DIR]                      create the pools (with their limits) and deployments
    python -m flows.farm submit [--config-dir DIR] [--wait] key=value ...   ship what the build reads, route it to its pool
    python -m flows.farm submit -m target=sm_80,sm_86 precision=fp16,int8    one build per combination; waits, one table
    prefect worker start --pool trtforge-rtx       on every host that builds (TensorRT-RTX builds on any CPU)
    prefect worker start --pool trtforge-sm_90     on a host with an sm_90 GPU and Enterprise TensorRT

Routing (conf/farm.yaml): a TensorRT-RTX target goes to the pool `trtforge-rtx`; an Enterprise-TensorRT target
`sm_XX` to `trtforge-sm_XX`, whose worker runs on a GPU host of that architecture. Every worker points at the same
Prefect server (PREFECT_API_URL) and the same MLflow tracking server (MLFLOW_TRACKING_URI), whose artifact store is
the farm's shared store (flows/farmstore.py): the submitter uploads the files the build reads there (flows/farmship.py)
and the workers share their stage cache through it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from flows.config import CONF_DIR
from flows.env import env_defaults

env_defaults()

from prefect import flow  # noqa: E402  (the farm is Prefect's engine through and through)

REPO = Path(__file__).resolve().parents[1]
FLOW = "trtforge-farm-build"
SENT = ("store", "lease_seconds", "wait_seconds")  # the submitter's settings a build runs with
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
MIN_LEASE_SECONDS = 60  # Prefect's shortest concurrency lease: its API refuses a shorter one (422) mid-build


def farm_settings() -> dict:
    """conf/farm.yaml; TRTFORGE_FARM_<SETTING> (e.g. TRTFORGE_FARM_STORE) overrides a setting on this host."""
    from omegaconf import OmegaConf

    s = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "farm.yaml"), resolve=True)
    for k, v in s.items():
        env = os.environ.get(f"TRTFORGE_FARM_{k.upper()}")
        if env is not None and not isinstance(v, dict):
            s[k] = type(v)(env) if isinstance(v, (int, float)) and not isinstance(v, bool) else env
    if float(s["lease_seconds"]) < MIN_LEASE_SECONDS:
        from tasks.common.errors import ConfigError

        raise ConfigError(f"lease_seconds={s['lease_seconds']:g} (conf/farm.yaml, or TRTFORGE_FARM_LEASE_SECONDS) is "
                          f"shorter than Prefect's shortest concurrency lease, {MIN_LEASE_SECONDS} s",
                          fix=f"set lease_seconds to {MIN_LEASE_SECONDS} or more")
    return s


def pool_for(target) -> str:
    """The work pool that builds for a target (its config node)."""
    return "trtforge-rtx" if target.backend == "tensorrt_rtx" else f"trtforge-{target.name}"


@flow(name=FLOW, persist_result=False, log_prints=True)
def farm_build(overrides: list[str], config_dir: str | None = None, shipped: dict | None = None,
               farm: dict | None = None, key: str | None = None, tolerance: float | None = None) -> dict:
    """One build on a worker (the deployments' entrypoint): fetch and check the shipped files, build with the farm's
    shared stage cache, leave the short result in the store; fails the flow run when the build is not ok."""
    from prefect.runtime import flow_run

    from flows.build import run_build
    from flows.cache import shared_cache
    from flows.config import compose_config
    from flows.farmship import KEY_TAG, MANIFEST_TAG, manifest_hash, materialize, rewritten
    from flows.farmstore import FarmStore, SharedStageCache

    s = {**farm_settings(), **(farm or {})}
    from flows.local.private import ensure

    # the fetched models, data and the modules the build imports: this user's alone (0700), refused (exit 2) otherwise
    store, workdir = FarmStore(s["store"]), ensure(Path(s["workdir"]).expanduser(), "the farm worker's folder",
                                                   "TRTFORGE_FARM_WORKDIR (or workdir in conf/farm.yaml)")
    build_dir, build_overrides = config_dir, overrides
    if shipped is not None:  # the build reads the fetched copies, never the submitter's paths
        build_dir, extra = materialize(shipped, workdir, store.get_blob)
        build_overrides = rewritten(overrides, extra)
    given = {o.split("=", 1)[0].lstrip("+~") for o in build_overrides}
    build_overrides = [*build_overrides, *(f"{k}={workdir / k.split('_')[0]}" for k in ("out_dir", "cache_dir")
                                           if k not in given)]  # this worker's own folders, not the flow's cwd
    caches: list[SharedStageCache] = []

    def cache(root: str) -> SharedStageCache:
        caches.append(SharedStageCache(root, store, workdir, float(s["lease_seconds"]), float(s["wait_seconds"])))
        return caches[-1]

    result: dict = {"overrides": overrides, "status": "failed"}
    try:
        with shared_cache(cache):
            summary = run_build(compose_config(build_overrides, build_dir), build_dir, show_progress=False,
                                overrides=overrides, recorded_config_dir=config_dir, tolerance=tolerance)
        result = short(summary)
        if shipped is not None and summary.get("mlflow", {}).get("run_id"):  # what a rebuild on the farm compares
            from flows.tracking import client
            for tag, value in ((MANIFEST_TAG, manifest_hash(shipped)), (KEY_TAG, key)):
                if value:
                    client().set_tag(summary["mlflow"]["run_id"], tag, value)
    except Exception as e:
        from tasks.common import TrtforgeError
        result["error"] = e.render() if isinstance(e, TrtforgeError) else f"{type(e).__name__}: {e}"
        raise
    finally:
        for c in caches:
            c.release()
        store.put_json(f"runs/{flow_run.get_id()}.json", result)
    if summary["status"] != "ok":
        raise RuntimeError(f"build failed: {summary.get('error', 'a stage failed')}")
    return result


def short(summary: dict) -> dict:
    """What a sweep's table and a rebuild need of a summary."""
    out = {k: summary.get(k) for k in ("model", "target", "precision", "status", "out_dir", "engine", "mlflow",
                                       "host", "error")}
    out["stages"] = {n: {k: v for k, v in e.items() if k in ("status", "reason", "cached_from", "seconds")}
                     for n, e in summary.get("stages", {}).items()}
    out["metrics"] = {k: v for k, v in summary.get("metrics", {}).items() if k in ("engine_bytes", "cosine_min")}
    return out


def setup(source: str = str(REPO)) -> list[str]:
    """Pools with their concurrency limits, and one deployment of the build flow per pool."""
    prefect = str(Path(sys.executable).with_name("prefect"))
    names = []
    for pool, opts in farm_settings()["pools"].items():
        subprocess.run([prefect, "work-pool", "create", pool, "--type", "process", "--overwrite"], check=True,
                       capture_output=True)
        if opts.get("concurrency"):
            subprocess.run([prefect, "work-pool", "set-concurrency-limit", pool, str(opts["concurrency"])], check=True,
                           capture_output=True)
        flow.from_source(source=source, entrypoint="flows/farm.py:farm_build").deploy(
            name=pool, work_pool_name=pool, print_next_steps=False)
        names.append(f"{FLOW}/{pool}")
    return names


def submit(overrides: list[str], config_dir: str | None = None, timeout: float = 0, tolerance: float | None = None):
    """Upload what the build reads to the farm's store (once per content), then route the build to its pool's
    deployment; `timeout` > 0 waits for it. Returns the flow run. ConfigError, before anything is uploaded, when a
    file a key names is missing."""
    from prefect.deployments import run_deployment

    from flows.cache import build_key
    from flows.config import compose_config
    from flows.farmship import blobs, collect, manifest_of
    from flows.farmstore import FarmStore

    cfg = compose_config(overrides, config_dir)
    items = collect(cfg, config_dir)
    shipped = manifest_of(items)
    s = farm_settings()
    roots = {i.key: i.root for i in items}
    FarmStore(s["store"]).put_blobs({sha: roots[key] / rel for sha, (key, rel) in blobs(shipped).items()})
    return run_deployment(f"{FLOW}/{pool_for(cfg.target)}", timeout=timeout,
                          parameters={"overrides": overrides, "shipped": shipped,
                                      "config_dir": str(Path(config_dir).expanduser().resolve()) if config_dir else None,
                                      "farm": {k: s[k] for k in SENT}, "key": build_key(cfg, config_dir),
                                      "tolerance": tolerance})


def wait_for(runs: list, timeout: float | None = None, poll: float = 2.0) -> dict:
    """Flow run id -> its final flow run (those not final by `timeout` seconds are left out)."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + (timeout if timeout else float(farm_settings()["wait_seconds"]))
    done: dict = {}
    with get_client(sync_client=True) as client:
        while len(done) < len(runs) and time.monotonic() < deadline:
            for r in runs:
                if r.id not in done:
                    fr = client.read_flow_run(r.id)
                    if fr.state_type.value in FINAL:
                        done[r.id] = fr
            if len(done) < len(runs):
                time.sleep(poll)
    return done


def result_of(run_id) -> dict | None:
    """What the farm build of this flow run left in the store (flows/farm.py farm_build), None before it ended."""
    from flows.farmstore import FarmStore

    return FarmStore(farm_settings()["store"]).get_json(f"runs/{run_id}.json")


def run_on_farm(overrides: list[str], config_dir: str | None = None, tolerance: float | None = None) -> dict:
    """Submit one build, wait for it, return its short result (flows.rebuild with farm=true)."""
    run = submit(overrides, config_dir, tolerance=tolerance)
    fr = wait_for([run]).get(run.id)
    r = result_of(run.id) or {}
    if fr is None:
        return {"status": "failed", "error": f"flow run {run.name} did not end within wait_seconds", **r}
    return {"status": "failed", "error": (fr.state.message or fr.state_type.value), **r} if not r.get("status") else r


def sweep(combos: list[list[str]], config_dir: str | None, out=print) -> int:
    """Submit every combination (bad input: reported, the rest still go), wait for all, print one table."""
    from tasks.common import TrtforgeError

    rows, runs, code = [], [], 0
    for ov in combos:
        try:
            run = submit(ov, config_dir)
            runs.append((ov, run))
            out(f"submitted {' '.join(ov)}: flow run {run.name} on pool {run.work_pool_name}")
        except TrtforgeError as e:
            rows.append({"overrides": ov, "status": "refused", "error": e.render()})
            code = max(code, e.exit_code)
    done = wait_for([r for _, r in runs])
    for ov, run in runs:
        fr = done.get(run.id)
        r = result_of(run.id) if fr is not None else None
        row = {"overrides": ov, "pool": run.work_pool_name, "run": run.name, **(r or {})}
        if fr is None:
            row.update(status="waiting", error=f"not done within {farm_settings()['wait_seconds']} s")
        elif r is None:
            row.update(status=fr.state_type.value.lower(), error=fr.state.message or "")
        rows.append(row)
        code = max(code, 0 if row["status"] == "ok" else 1)
    swept = [i for i in range(len(combos[0])) if len({c[i] for c in combos}) > 1] if combos else []
    out(table(rows, swept))
    return code


def table(rows: list[dict], swept: list[int] = ()) -> str:
    """One line per build: what (the overrides at the `swept` positions; all when none), where, how it ended, the
    engine, the accuracy, and whether calibration was reused."""
    head = ("build", "pool", "host", "status", "engine", "cosine_min", "calibrate", "mlflow run")
    lines = [head]
    for r in rows:
        m, cal = r.get("metrics") or {}, (r.get("stages") or {}).get("calibrate") or {}
        reuse = cal.get("status", "")
        if cal.get("cached_from"):
            reuse = "cached" if reuse == "cached" else "partly cached"
        what = [o for i, o in enumerate(r["overrides"]) if i in swept] or r["overrides"]
        lines.append((" ".join(what), r.get("pool", ""), r.get("host") or "", r["status"],
                      f"{m['engine_bytes'] / 2**20:.1f} MiB" if m.get("engine_bytes") else "",
                      f"{m['cosine_min']:.6f}" if m.get("cosine_min") is not None else "", reuse,
                      (r.get("mlflow") or {}).get("run_id") or ""))
    widths = [max(len(str(x[i])) for x in lines) for i in range(len(head))]
    text = ["  ".join(str(x[i]).ljust(widths[i]) for i in range(len(head))).rstrip() for x in lines]
    errors = [f"  {' '.join(r['overrides'])}: {r['error'].splitlines()[0]}" for r in rows
              if r["status"] != "ok" and r.get("error")]
    return "\n".join(text + (["errors:"] + errors if errors else []))


def main(argv: list[str] | None = None) -> int:
    from flows.cli import expand_overrides
    from tasks.common import TrtforgeError

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("setup", "submit"):
        print(__doc__.split("\n\n")[1])
        return 2
    if args[0] == "setup":
        kv = dict(a.split("=", 1) for a in args[1:])
        for name in setup(**kv):
            print(f"deployment {name}")
        return 0
    rest, config_dir, multirun, wait = args[1:], None, False, False
    plain = []
    while rest:
        a = rest.pop(0)
        if a == "--config-dir" and rest:
            config_dir = rest.pop(0)
        elif a.startswith("--config-dir="):
            config_dir = a.split("=", 1)[1]
        elif a in ("-m", "--multirun"):
            multirun = True
        elif a == "--wait":
            wait = True
        else:
            plain.append(a)
    combos = expand_overrides(plain, multirun)
    if multirun or wait:
        return sweep(combos, config_dir)
    try:
        run = submit(combos[0], config_dir)
    except TrtforgeError as e:
        print(f"trtforge: error: {e.render()}", file=sys.stderr)
        return e.exit_code
    print(f"flow run {run.id} ({run.name}) on pool {run.work_pool_name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
