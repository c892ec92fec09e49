"""ONNX Runtime on this host: the one session factory every stage uses (the fp32 reference, the precision graphs, the
native segments of a hybrid model, calibration and benchmark), and running a session on a feed."""
from __future__ import annotations

import collections
import contextlib
import logging
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from tasks.common.errors import StageError, cause

# graph optimization levels: "all" = ONNX Runtime's default; "basic" = fewer float fusions; "none" = the graph exactly
# as written. At every level a session made with ``exact=True`` (the default: every accuracy figure) keeps Q/DQ as
# written: ONNX Runtime's QDQ fusions into integer kernels (QLinearConv, ...) are off and integer ops are rewritten to
# float (tasks/onnxrt/exact.py ``exact_integer_ops``), because those kernels differ by CPU (an AVX2 host without VNNI
# saturates u8 x s8 products in 16 bits) while TensorRT accumulates int8 products exactly.
OPTIMIZATION = ("all", "basic", "none")


def quiet_onnxruntime() -> None:
    """ONNX Runtime's default logger at errors only. Sessions that libraries make (ONNX Runtime's own calibrator's)
    log with it, and their warnings ("Error merging shape info for output ...") reached the user's console; what
    matters to a build, trtforge says itself."""
    import onnxruntime as ort

    ort.set_default_logger_severity(3)


def ort_session(model: Path | bytes, *, optimization: str = "all", threads: int = 0, spinning: bool = False,
                arena: bool = True, stage: str = "validate", file: str | None = None, exact: bool = True,
                mem_pattern: bool = True):
    """A CPU session for an ONNX file (or serialized model bytes). Idle worker threads do not busy-wait unless
    `spinning` (benchmark: ONNX Runtime's default, for its latency); ORT's own printing is quiet, errors come back as a
    StageError with ONNX Runtime's reason first. ``arena=False``: no CPU memory arena (it keeps the peak of every run
    per session: a hybrid model composed of a few hundred segment sessions held ~12 GB that way). ``mem_pattern=False``:
    each value allocated from the arena as the run reaches it, not one block planned for the whole run (ONNX Runtime's
    memory pattern): the same numbers, and 8-20% less CPU per run of the accuracy search's switchable graph (PP-OCRv4
    det, ~1000 nodes and 72 If switches, measured interleaved on 3 flag sets). ``exact`` (default):
    quantized arithmetic as written, the same on every x86-64 CPU (see OPTIMIZATION); ``exact=False`` lets ONNX Runtime
    pick its integer kernels (the benchmark: how fast this host runs the model, not what it computes)."""
    import onnxruntime as ort

    quiet_onnxruntime()
    if optimization not in OPTIMIZATION:
        raise ValueError(f"optimization={optimization!r}: use one of {OPTIMIZATION}")
    qdq = False
    if exact:
        from tasks.onnxrt.exact import exact_integer_ops_of

        model, qdq = exact_integer_ops_of(model)
    so = ort.SessionOptions()
    # a graph with Q/DQ at most "basic": ONNX Runtime's extended/layout optimizations change what its Q/DQ compute even
    # with the QDQ fusions off (PP-OCRv4 det's int8 graph: cosine 0.9959 between "all" and the graph as written)
    level = "basic" if qdq and optimization == "all" else optimization
    so.graph_optimization_level = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                                   "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                                   "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}[level]
    so.log_severity_level = 4
    so.enable_cpu_mem_arena = arena
    so.enable_mem_pattern = mem_pattern
    if threads:
        so.intra_op_num_threads = threads
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if exact:
        so.add_session_config_entry("session.disable_quant_qdq", "1")  # Q/DQ stay float ops: no integer kernels
    try:
        return ort.InferenceSession(model if isinstance(model, bytes) else str(model), so,
                                    providers=["CPUExecutionProvider"])
    except Exception as e:
        where = file or (None if isinstance(model, bytes) else str(model))
        raise StageError(f"ONNX Runtime cannot load the model: {cause(e)}", stage=stage, file=where) from e


def ort_run(session, feed: dict[str, np.ndarray], stage: str = "validate",
            options=None) -> dict[str, np.ndarray]:
    """{output name: array} of one run (``options``: its onnxruntime.RunOptions, e.g. from ``RunControl``)."""
    try:
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, feed, options)))
    except Exception as e:
        shapes = {k: list(v.shape) for k, v in feed.items()}
        raise StageError(f"ONNX Runtime failed on inputs {shapes}: {cause(e)}", stage=stage) from e


RUN_WORKERS = 2  # runs of one session at once (ordered_runs)
LARGE_RUN_BYTES = 3 << 29  # a run that holds (or computes) more values than this runs alone: IS-Net at 1024x1024
# fetches 1.8 GiB of activations a feed for its ranges (two at a time, with the arenas that keep each run's peak: ~9 GB)
# and computes 2.6 GiB of values a run; PP-OCRv5 det at 960x960 computes 1.2 GiB (0.07 GiB alive at once)


def runs_alone(held: int) -> bool:
    """Whether a run that holds ``held`` bytes of values runs alone (on every core, its sessions without an arena)."""
    return held > LARGE_RUN_BYTES


def run_workers(held: int = 0) -> tuple[int, int]:
    """(runs at once, threads per run) for ``ordered_runs``: at most RUN_WORKERS runs (each holds its own
    activations), the cores of this process shared between them; one run on every core when a run holds ``held``
    bytes past LARGE_RUN_BYTES."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    workers = 1 if runs_alone(held) else max(1, min(RUN_WORKERS, cores))
    return workers, max(1, cores // workers)


def ordered_runs(run: Callable, items, workers: int, keep: Callable | None = None,
                 abandon: Callable | None = None) -> Iterator:
    """``run(item)`` for each of ``items`` in order, up to ``workers`` of them running at once (ONNX Runtime releases
    the GIL while it runs). Runs of a session with fewer threads each (``run_workers``): a session's threads sleep
    between the parallel parts of its nodes (no spinning), and a graph of many small nodes waits on their wake-ups;
    two single-threaded runs at once wait on none (the accuracy search's switchable graph of PP-OCRv4 det, ~1300 nodes,
    on an idle 2-core host, 4 alternating rounds: 0.104-0.128 s a page against 0.110-0.145 s one run at a time on two
    threads). The results are those of one run at a time of the same session. A consumer that stops early leaves
    nothing running: the runs started ahead are finished, and ``keep(item, result)`` gets each (a judgement refused
    after a few feeds keeps the run ahead for the next judgement of the same candidate); with ``abandon``, each run
    ahead is first told to stop (``abandon(item)``, e.g. ``RunControl.stop``): a run that stops raises and is dropped,
    one that finished first is kept. Each run ahead goes on a
    thread of its own, a daemon (~0.1 ms to start against a run's ~0.1 s): no pool outlives the call, so nothing
    holds up the CLI's exit (flows/cli.exit_now joins every thread that is not a daemon) or a forked child."""
    if workers <= 1:
        for item in items:
            yield run(item)
        return
    ahead: collections.deque = collections.deque()
    try:
        for item in items:
            ahead.append((item, _started(run, item)))
            if len(ahead) >= workers:
                yield ahead.popleft()[1].result()
        while ahead:
            yield ahead.popleft()[1].result()
    finally:
        if abandon is not None:
            for item, _ in ahead:
                abandon(item)
        for item, future in ahead:
            try:
                out = future.result()
            except Exception:  # noqa: BLE001 - nobody asked for it: the consumer stopped (or failed) before
                continue
            if keep is not None:
                keep(item, out)


class RunControl:
    """Runs that can be told to stop, by a key of the caller's (``ordered_runs``' ``abandon``): ``options(key)`` gives
    a run its onnxruntime.RunOptions, ``stop(key)`` sets their terminate flag (ONNX Runtime checks it between nodes and
    raises), so a run nobody will read gives its core back at once instead of running to its end."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._live: dict = {}

    def options(self, key):
        import onnxruntime as ort

        ro = ort.RunOptions()
        ro.log_severity_level = 4
        with self._lock:
            self._live[key] = ro
        return ro

    def stop(self, key) -> None:
        with self._lock:
            ro = self._live.pop(key, None)
        if ro is not None:
            ro.terminate = True

    def done(self, key, ro) -> None:
        """The run of ``key`` with options ``ro`` ended: nothing left to stop."""
        with self._lock:
            if self._live.get(key) is ro:
                del self._live[key]


def _started(run: Callable, item):
    """A Future of ``run(item)``, computed on a new daemon thread."""
    import threading
    from concurrent.futures import Future

    future: Future = Future()

    def work() -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(run(item))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, in the result's place
            future.set_exception(e)
    threading.Thread(target=work, name="trtforge-run", daemon=True).start()
    return future


def ort_runner(model: Path | bytes, optimization: str = "all", stage: str = "validate", arena: bool = True,
               threads: int = 0) -> Callable:
    """feed -> {output: array}, for one model (a session of ``threads`` threads; 0: ONNX Runtime's default)."""
    sess = ort_session(model, optimization=optimization, stage=stage, arena=arena, threads=threads)
    return lambda feed: ort_run(sess, feed, stage=stage)


@contextlib.contextmanager
def quiet_python_logging() -> Iterator[None]:
    """ORT's quantization tools log warnings ("consider pre-processing", bias not an initializer) on every call."""
    logger = logging.getLogger()
    old = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(old)
