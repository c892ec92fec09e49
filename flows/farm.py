"""The build farm on Prefect: one process work pool per backend and architecture, one worker per host.

    python -m flows.farm setup [source=DIR]        create the pools (with their concurrency limits) and deployments
    python -m flows.farm submit key=value ...      route one build to its pool; prints the flow run
    prefect worker start --pool trtforge-rtx       on every host that builds (TensorRT-RTX builds on any CPU)
    prefect worker start --pool trtforge-sm_90     on a host with an sm_90 GPU and Enterprise TensorRT

Routing (conf/farm.yaml): a TensorRT-RTX target goes to the pool `trtforge-rtx`; an Enterprise-TensorRT target
`sm_XX` to `trtforge-sm_XX`, whose worker runs on a GPU host of that architecture. Every worker points at the same
Prefect server (PREFECT_API_URL) and the same MLflow tracking server (MLFLOW_TRACKING_URI).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from flows.config import CONF_DIR
from flows.env import env_defaults

env_defaults()

from prefect import flow  # noqa: E402  (the farm is Prefect's engine through and through)

REPO = Path(__file__).resolve().parents[1]
FLOW = "trtforge-farm-build"


def farm_settings() -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(CONF_DIR / "farm.yaml"), resolve=True)


def pool_for(target) -> str:
    """The work pool that builds for a target (its config node)."""
    return "trtforge-rtx" if target.backend == "tensorrt_rtx" else f"trtforge-{target.name}"


@flow(name=FLOW, persist_result=False, log_prints=True)
def farm_build(overrides: list[str], config_dir: str | None = None) -> dict:
    """One build on a worker (the deployments' entrypoint); fails the flow run when the build is not ok."""
    from flows.build import run_build
    from flows.config import compose_config

    summary = run_build(compose_config(overrides, config_dir), config_dir, show_progress=False, overrides=overrides)
    if summary["status"] != "ok":
        raise RuntimeError(f"build failed: {summary.get('error', 'a stage failed')}")
    return {k: summary.get(k) for k in ("model", "target", "precision", "status", "out_dir", "engine", "mlflow")}


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


def submit(overrides: list[str], config_dir: str | None = None, timeout: float = 0):
    """Route a build to its pool's deployment; `timeout` > 0 waits for it. Returns the flow run."""
    from prefect.deployments import run_deployment

    from flows.config import compose_config

    cfg = compose_config(overrides, config_dir)
    return run_deployment(f"{FLOW}/{pool_for(cfg.target)}", parameters={"overrides": overrides, "config_dir": config_dir},
                          timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in ("setup", "submit"):
        print(__doc__.split("\n\n")[1])
        return 2
    if args[0] == "setup":
        kv = dict(a.split("=", 1) for a in args[1:])
        for name in setup(**kv):
            print(f"deployment {name}")
        return 0
    config_dir = next((a.split("=", 1)[1] for a in args[1:] if a.startswith("--config-dir=")), None)
    run = submit([a for a in args[1:] if not a.startswith("--config-dir=")], config_dir)
    print(f"flow run {run.id} ({run.name}) on pool {run.work_pool_name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
