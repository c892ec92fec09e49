"""`python -m flows.build [--config-dir DIR] [-m] key=value ...`: one model to TensorRT engines for one target.

The flow, on one screen: export -> partition -> build -> calibrate -> validate -> benchmark.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C during the imports below: the CLI's one line, not a traceback from an import
    from flows.local.termination import on_ctrl_c_while_starting

    on_ctrl_c_while_starting()

import json  # noqa: E402
import os
import shutil
import socket
import sys
import time
import uuid
from contextvars import ContextVar
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # the CLI: with TRTFORGE_DAEMON=1 a warm build process takes the build when one is up
    from flows.local.daemon import delegate  # (flows/local/daemon.py)

    _status = delegate(sys.argv[1:])
    if _status is not None:
        sys.exit(_status)
    if not {"-h", "--help", "-c", "--cfg"} & set(sys.argv[1:]):  # the shared local Prefect server (when none runs)
        from flows.env import env_defaults                          # starts while this process imports and checks
        from flows.local.server import begin                              # its input (stopped again when no flow needs it)
        from flows.local import tracker  # and the build's tracker loads MLflow (ends with this process when unused)
        from tasks.common import ConfigError

        env_defaults()
        try:
            begin()
        except ConfigError:  # a folder that is not the user's own (private.NotPrivate): main() says so, exit 2
            pass
        tracker.start()

from flows.env import env_defaults  # noqa: E402

env_defaults()  # before Prefect and MLflow are imported

from omegaconf import DictConfig, OmegaConf  # noqa: E402
from flows.local import server as prefect_server  # noqa: E402
from flows import stages, timeline  # noqa: E402
from flows.context import CODE, TRTFORGE_VERSION, BuildContext, BuildIdentity  # noqa: E402
from flows.lazy import NONE, flow, task  # noqa: E402  (Prefect is imported when a build has work)
from flows.cache import (build_key, new_result_dir, named_lock, publish_dir, published,  # noqa: E402
                         remove_result, result_dir, stage_cache)
from flows.cli import expand_overrides, parse_args, print_stage, print_summary  # noqa: E402
from flows.config import compose_config, flat_params, preflight  # noqa: E402
from flows.sweep import jobs, run_sweep  # noqa: E402
from flows.local import tracker  # noqa: E402
from flows.local.termination import end_if_terminated, watch_termination  # noqa: E402
from flows.tracking import failure_text, run_matches, warm, warmed  # noqa: E402
from tasks.common import TrtforgeError, cause  # noqa: E402
from tasks.report import write_report  # noqa: E402
from tasks.schema import STAGES  # noqa: E402
from tasks.common import write_json  # noqa: E402
from tasks.common import MemoryWatch, budget_from_config  # noqa: E402
from flows.local.private import for_user  # noqa: E402  (results follow the user's umask)


@task(task_run_name="{name}", cache_policy=NONE, persist_result=False)
def stage(name: str) -> None:
    _current.get().run(name, stages.TABLE[name].run)


# the build this flow runs: not a parameter of the flow or its tasks (Prefect walks every parameter of every task run
# looking for futures, and encodes the flow's for its API with FastAPI's encoder, importing FastAPI: a build's whole
# context, config and data included, each time)
_current: ContextVar[BuildContext] = ContextVar("trtforge_build")


def run_name() -> str:
    cfg = _current.get().cfg
    return f"{cfg.model.name}-{cfg.target.name}-{cfg.precision.name}"


@task(name="track", cache_policy=NONE, persist_result=False, retries=2, retry_delay_seconds=2)
def track(**kwargs: Any) -> dict:
    # in the build's tracker process, where MLflow loaded meanwhile; the run is owned by this process (a run it leaves
    # RUNNING when killed is ended by the next build once this pid is gone)
    return tracker.call("log_build", pid=os.getpid(), **kwargs)


def end_run(run_id: str, ok: bool, failure: BaseException | None = None) -> None:
    tracker.call("end_run", run_id=run_id, ok=ok, failure=None if failure is None else failure_text(failure))


@flow(name="trtforge-build", flow_run_name=run_name, validate_parameters=False, persist_result=False)
def build_flow() -> dict:
    """The build of the context set in `_current` (run_build)."""
    from prefect.runtime import flow_run

    watch_termination()  # a SIGTERM or Ctrl-C from here on ends the build by it, whatever code it arrives in
    ctx = _current.get()
    ctx.origin = {"run": f"{flow_run.get_name()} ({flow_run.get_id()})"}  # stored with every result computed here
    timeline.mark("flow run started")
    for name in STAGES:  # export, partition, build, calibrate, validate, benchmark
        stage(name)
        if name == "validate" and stages.fp16_search_due(ctx):
            search_and_revalidate(ctx)
        if ctx.error is not None and ctx.error.exit_code != 1:
            return None  # bad input (or a host that cannot build it) found mid-way: nothing is published or tracked
    timeline.mark("stages done")
    end_if_terminated()  # a stage that took a SIGTERM or Ctrl-C for an error of its own: nothing is published
    return publish(ctx)


def search_and_revalidate(ctx: BuildContext) -> None:
    """fp16 that missed the budget in validate: build again with the fp16 accuracy search (held-out samples only), then
    validate the searched graph. Each stage's entry keeps the first attempt's seconds in its total and says so."""
    first = {n: ctx.stages.get(n, {}) for n in ("build", "validate")}
    for n in first:
        ctx.stages[n] = {}  # the entry starts afresh, in its place
    ctx.fp16_search, ctx.failed, ctx.error = True, None, None
    for n in ("build", "validate"):
        attempt = {k: first[n][k] for k in ("status", "seconds", "reason", "peak_rss_mib") if first[n].get(k) is not None}
        if ctx.failed:
            ctx.stages[n] = {"status": "skipped", "seconds": 0.0, "reason": f"the {ctx.failed} stage failed",
                             "first_attempt": attempt}
            continue
        stage(n)
        e = ctx.stages[n]
        e["first_attempt"] = attempt
        e["seconds"] = round(e.get("seconds", 0.0) + (first[n].get("seconds") or 0.0), 3)
        if "peak_rss_mib" in attempt:  # the stage's peak over both attempts
            e["peak_rss_mib"] = max(e.get("peak_rss_mib", 0.0), attempt["peak_rss_mib"])
        if n == "build":
            m = ctx.results["build"].metrics if e.get("status") != "failed" else {}
            e["fp16_search"] = (
                "the fp16 graph as converted missed the accuracy budget in validate; the fp16 accuracy search ran" + (
                    f" and kept nothing: its {m.get('search_samples')} held-out samples meet its target with the graph "
                    "as converted" if m.get("fallback_layers") == 0 else ""))


def publish(ctx: BuildContext) -> dict:
    """Write the result in a fresh folder, log the MLflow run from it, then make it current in one atomic swap."""
    cfg = ctx.cfg
    ok = ctx.failed is None
    final = result_dir(cfg, ok)
    summary: dict[str, Any] = {"model": cfg.model.name, "target": cfg.target.name, "precision": cfg.precision.name,
                               "status": "ok" if ok else "failed", "out_dir": str(final), "engines": [], "engine": None,
                               "stages": ctx.stages, "metrics": {}}
    tmp = new_result_dir(final)
    m = ctx.metrics
    if ok:
        summary["engines"] = publish_engines(ctx, tmp)
        summary["engine"] = summary["engines"][0]
        m["engine_bytes"] = sum(e["bytes"] for e in summary["engines"])  # the shipped files, byte for byte
    if ctx.memory is not None:  # measured on this run (stages served from the cache included), with its budget
        m["peak_rss_mib"] = ctx.memory.peak_mib
        if ctx.memory.budget is not None:
            summary["memory"] = ctx.memory.budget.as_dict()
        if ctx.inputs.memory_estimate is not None:  # the lower bound preflight checked: estimated, not measured
            summary.setdefault("memory", {}).update(ctx.inputs.memory_estimate.as_dict())
    summary["metrics"] = {k: v for k, v in sorted(m.items())}
    if ctx.error is not None:
        summary["error"] = ctx.error.render()
    for name, r in ctx.results.items():
        for key, fname in (("partition", "partition.json"), ("graph", "partition.png"), ("validation", "validation.json"),
                           ("benchmark", "benchmark.json"), ("sensitivity", "sensitivity.json"),
                           ("sensitivity_plot", "sensitivity.png"), ("precision_profile", "precision_profile.json"),
                           ("precision_profile_plot", "precision_profile.png"), ("prequant", "prequant.json"), ("accuracy_plot", "accuracy.png"),
                           ("latency_plot", "latency.png")):
            if key in r.files:
                (tmp / fname).write_bytes(Path(r.files[key]).read_bytes())
    if "validate" in ctx.results:  # the accuracy verdict in words: what was measured, on what, and how strong it is
        summary["verdict"] = ctx.results["validate"].details.get("verdict")
        if ctx.results["validate"].details.get("accuracy"):  # the metric, its settings, its value per output and sample
            summary["accuracy"] = ctx.results["validate"].details["accuracy"]
    if ctx.inputs.traffic is not None:  # the profiles from the traffic: coverage, outliers, the picture
        from tasks.data import plot as traffic_plot
        summary["traffic"] = ctx.inputs.traffic[1].as_dict()
        summary["metrics"]["traffic_coverage"] = ctx.inputs.traffic[1].coverage
        traffic_plot(*ctx.inputs.traffic, tmp / "traffic.png")
    data = ctx.data.summary()  # calibration / search / validation: disjoint sets, their samples and source
    if data:
        summary["data"] = data
    resolved = OmegaConf.to_yaml(cfg)
    (tmp / "config.yaml").write_text(resolved)
    summary["versions"] = versions(ctx)
    summary["host"] = socket.gethostname()  # where these numbers were measured (an up-to-date answer says so)
    summary["cache_key"] = ctx.identity.cache_key
    summary["inputs"] = ctx.deps  # every file the stages read and library they used: an up-to-date answer checks them
    write_json(tmp / "summary.json", summary)
    write_report(tmp)
    run = None
    try:
        run = track(experiment=cfg.experiment, summary=dict(summary), params=flat_params(cfg), resolved_yaml=resolved,
                    out_dir=tmp, engine_files=[tmp / e["file"] for e in summary["engines"]], versions=summary["versions"],
                    build_id=ctx.identity.build_id, provenance={"config_dir": ctx.identity.config_dir,
                                                                "overrides": ctx.identity.overrides},
                    tolerance=ctx.identity.tolerance, started=ctx.identity.started)
        summary["mlflow"] = run
        timeline.mark("tracked")
        write_json(tmp / "summary.json", summary)  # with its run: what the up-to-date check compares
        publish_dir(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if run is not None:  # logged, but the result did not make it: the run says so
            end_run(run["run_id"], ok=False, failure=e)
        raise
    if ok:  # a stale failure report beside a good result would mislead
        remove_result(final.with_name(final.name + ".failed"))
    for entry, key in ctx.computed:  # later builds served from these entries say which run measured them
        ctx.cache.annotate(entry, key, {"mlflow_run": run["run_id"]})
    if cfg.summary_out:
        for_user(write_json(cfg.summary_out, summary))
    return summary


def publish_engines(ctx: BuildContext, out: Path) -> list[dict]:
    """Copy (hard-link when possible) the deliverable engine(s), one per TensorRT segment, into the output folder."""
    from tasks.engines import engines_of
    from tasks.common import sha256_file

    result = []
    for _, src, _ in engines_of(stages.deliverable(ctx)):
        dst = out / Path(src).name
        try:
            dst.hardlink_to(src)
        except OSError:
            shutil.copy2(src, dst)
        result.append({"file": dst.name, "sha256": sha256_file(dst), "bytes": dst.stat().st_size})
    return result


def versions(ctx: BuildContext) -> dict[str, str]:
    """Every version read from the library it names (or "not present"), never a fixed string."""
    import onnx
    import onnxruntime

    from tasks.trt import host_gpus
    from tasks.trt import cuda_versions

    v = {"trtforge": TRTFORGE_VERSION, "code": CODE, "backend": ctx.backend.version, "onnx": onnx.__version__,
         "onnxruntime": onnxruntime.__version__, "python": sys.version.split()[0], **cuda_versions()}
    gpus = host_gpus()
    v["gpu"] = ", ".join(f"{g.name} (sm {g.compute_capability})" for g in gpus) or "not present"
    v["driver"] = gpus[0].driver if gpus else "not present"
    return v


# --- running builds ---------------------------------------------------------------------------------------------

def run_build(cfg: DictConfig, config_dir: str | None = None, show_progress: bool = True,
              on_stage=None, overrides: list[str] | None = None, tolerance: float | None = None,
              started: float | None = None, recorded_config_dir: str | None = None) -> dict:
    """The published result when it is up to date (no server, no new run); else validate the whole config and run
    the flow. Raises ConfigError on bad input, found before the flow or by a
    stage (no run is created), UnavailableError when this host cannot build the target. `overrides` and `config_dir` are recorded in the
    run, so a scheduled rebuild can re-resolve the config; `tolerance`: see flows.registry.register_engines.
    `started` (epoch seconds, default now): when the build began, the start of its MLflow run.
    `recorded_config_dir`: the config dir to record when the build reads a copy of it (a farm worker's)."""
    started = time.time() if started is None else started
    key = build_key(cfg, config_dir)
    done = up_to_date(cfg, key)
    if done is None:
        # one build per result folder at a time: an identical build waits, then finds the result up to date
        with named_lock(result_dir(cfg), "build"):
            done = up_to_date(cfg, key)
            if done is None:
                # the shared local Prefect server starts (unless one runs) while Prefect and MLflow load in the
                # background and preflight checks the inputs
                warm(prefect=prefect_server.begin(), mlflow=not tracker.start())
                timeline.mark("work found")
                identity = BuildIdentity(
                    cache_key=key, build_id=uuid.uuid4().hex, tolerance=tolerance, started=started,
                    config_dir=recorded_config_dir or (str(Path(config_dir).expanduser().resolve()) if config_dir else ""),
                    overrides=json.dumps(list(overrides) if overrides is not None else None))
                # the build's resident memory from here on: per stage, overall, and the budget it stays within
                memory = MemoryWatch(budget_from_config(cfg.memory_budget_mib)).start()
                try:
                    ctx = BuildContext(cfg=cfg, inputs=preflight(cfg, config_dir, memory.budget), identity=identity,
                                       cache=stage_cache(cfg.cache_dir), show_progress=show_progress, on_stage=on_stage,
                                       memory=memory)
                except BaseException:
                    memory.close()
                    raise
                timeline.mark("preflight done")
                prefect_server.ensure()  # the user's shared local Prefect server answers (waits for its start)
                timeline.mark("prefect server answers")
                warmed()  # the background imports are done: Prefect and MLflow are imported by one thread at a time
                token = _current.set(ctx)
                try:
                    with prefect_server.lease(), prefect_server.without_heartbeats():
                        summary = build_flow()
                finally:
                    _current.reset(token)
                    memory.close()
                if summary is None:  # bad input found by a stage: nothing published or tracked
                    raise ctx.error
                timeline.mark("flow done")
                # published and registered, the flow done: only now is the run ok and FINISHED, ending with the build
                end_run(summary["mlflow"]["run_id"], ok=summary["status"] == "ok")
                timeline.mark("run ended")
                return summary
    if on_stage:
        for name, entry in done["stages"].items():
            on_stage(name, entry)
    if cfg.summary_out:
        for_user(write_json(cfg.summary_out, done))
    return done


def up_to_date(cfg: DictConfig, key: str) -> dict | None:
    """The published ok result of a build with this key whose MLflow run is in the tracking store, its stages
    marked `cached` (and from when); None when there is work to do."""
    from datetime import datetime, timezone

    s = published(cfg, key)
    run = run_matches(s["mlflow"]["run_id"], key) if s else None
    if run is None:
        return None
    when = datetime.fromtimestamp(run["start_time"] / 1000, timezone.utc).isoformat(timespec="seconds")
    origin = {"at": when, "host": s.get("host", "?"), "mlflow_run": s["mlflow"]["run_id"]}
    for entry in s["stages"].values():
        if entry["status"] in ("ok", "cached"):
            entry.setdefault("cached_from", origin)  # a stage that run itself took from the cache keeps its origin
            entry.update(status="cached", seconds=0.0, reason=f"up to date: built {when}")
    s["up_to_date"] = when
    return s


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """The CLI. `started`: when the command began (epoch seconds; a warm process gets the caller's), default now."""
    started = time.time() if started is None else started
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args is None:
        return 0
    code = 0
    combos = expand_overrides(args.overrides, args.multirun)
    if len(combos) > 1 and not args.cfg and jobs(len(combos)) > 1:  # builds in parallel processes
        def report(r: dict) -> None:
            if "summary" in r:
                for name, entry in r["summary"]["stages"].items():
                    print_stage(name, entry)
                print_summary(r["summary"], r["seconds"])
            else:
                print(f"trtforge: error: {' '.join(r['overrides'])}: {r['error']}", file=sys.stderr)
        code = run_sweep(combos, args.config_dir, report, run_build, up_to_date)
        prefect_server.release_unused()
        return code
    for i, overrides in enumerate(combos):
        started = started if i == 0 else time.time()  # each build of a list starts when the one before ended
        timeline.mark("command started", started)
        try:
            cfg = compose_config(overrides, args.config_dir)
            if args.cfg:
                print(OmegaConf.to_yaml(cfg))
                continue
            summary = run_build(cfg, args.config_dir, show_progress=sys.stderr.isatty(), on_stage=print_stage,
                                overrides=overrides, started=started)
            if summary.get("up_to_date"):
                print(f"up to date: the published result and its MLflow run match the inputs (built "
                      f"{summary['up_to_date']}); nothing to do")
            print_summary(summary, time.time() - started)
            code = max(code, 0 if summary["status"] == "ok" else 1)
            timeline.mark("reported")
            timeline.flush()
        except TrtforgeError as e:
            if os.environ.get("TRTFORGE_TRACEBACK"):
                raise
            print(f"trtforge: error: {e.render()}", file=sys.stderr)
            code = max(code, e.exit_code)
        except Exception as e:  # a bug or an environment failure (e.g. the tracking store): short, then non-zero
            if os.environ.get("TRTFORGE_TRACEBACK"):
                raise
            print(f"trtforge: internal error: {type(e).__name__}: {cause(e)}\n"
                  "  fix: rerun with TRTFORGE_TRACEBACK=1 for the traceback and report it", file=sys.stderr)
            code = max(code, 1)
    prefect_server.release_unused()
    return code


def cli(argv: list[str], started: float | None = None):
    """The CLI as its process runs it, in its own process or forked from a warm one (flows/local/daemon.py): the same
    output, exit status, SystemExit message and death by signal either way (flows/cli.py finish). Never returns."""
    from flows.cli import finish
    from flows.local.termination import ctrl_c_as_keyboard_interrupt

    ctrl_c_as_keyboard_interrupt()
    finish(lambda: main(argv, started=started))


if __name__ == "__main__":
    cli(sys.argv[1:])
