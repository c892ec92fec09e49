"""The build fallback as the flow runs it: when TensorRT cannot build a segment, re-plan the partition so that what
failed runs in ONNX Runtime (tasks.partition.partition.build_fallback), at most MAX_REPLANS times, and try again; the
re-plans are said in the partition stage's note. Used by the build and calibrate stages (flows/stages.py)."""
from __future__ import annotations

import contextlib
from typing import Callable

from flows.context import BuildContext
from tasks.common import StageError, StageResult
from tasks.partition import REDUCE_BUILD_SECONDS

MAX_REPLANS = 4  # builds re-planned after a failure, at most


def with_replans(ctx: BuildContext, attempt: Callable[[], StageResult],
                 repartition: Callable[[BuildContext, dict], StageResult],
                 on: type[StageError] = StageError) -> StageResult:
    """``attempt()`` (engines built from the current plan); when it fails with ``on`` (TensorRT could not build a
    segment), the plan that runs what failed in ONNX Runtime (tasks.partition.partition.build_fallback, at most MAX_REPLANS times)
    and ``attempt()`` again on it; the re-plans said in the partition stage's note."""
    from tasks.engines import build_error
    from tasks.data import generated_feeds
    from tasks.partition import build_fallback

    i, notes, cfg, t = ctx.inputs, [], ctx.c("partition"), ctx.cfg.target
    for n in range(MAX_REPLANS + 1):
        try:
            r = attempt()
            break
        except on as e:
            with _bisect_progress(ctx.show_progress, n + 1) as progress:
                replan = None if n == MAX_REPLANS else build_fallback(
                    cfg, ctx.results["export"].files["onnx"], ctx.results["partition"].details, e,
                    lambda: generated_feeds(i.inputs, i.profiles[:1], 0, ctx.cfg.seed, rules=i.rules),
                    lambda m, p: build_error(m, p, ctx.cfg.precision.baseline, t.compute_capability, ctx.c("build"),
                                             ctx.backend, seconds=REDUCE_BUILD_SECONDS), progress=progress)
            if replan is None:
                if notes:  # what the fallback did before it gave up, once, after the builder's own words
                    e.message += f" (after {len(notes)} re-plan{'s' if len(notes) > 1 else ''} that ran the nodes " \
                                 "TensorRT could not build in ONNX Runtime; partition.json lists them)"
                    e.args = (e.render(),)
                raise
            cfg, note = replan
            ctx.results["partition"] = plan = repartition(ctx, cfg)
            ctx.metrics.update(plan.metrics)
            notes.append(note)
    if notes:
        previous = ctx.stages["partition"].get("note")
        ctx.stages["partition"]["note"] = "; ".join([previous, *notes] if previous else notes)
    return r


@contextlib.contextmanager
def _bisect_progress(show: bool, replan: int):
    """One status line on stderr while the fallback bisects: which build, of at most how many, and for how long."""
    if not show:
        yield None
        return
    from rich.console import Console

    with Console(stderr=True).status(f"  build failed: looking for the nodes TensorRT cannot build (re-plan {replan})") \
            as status:
        yield lambda k, cap, seconds: status.update(
            f"  build failed: bisecting the segment, build {k} of at most {cap} ({seconds:.0f} s; each at most "
            f"{REDUCE_BUILD_SECONDS:.0f} s), re-plan {replan}")
