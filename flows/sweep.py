"""Sweeps (`python -m flows.build -m target=a,b precision=x,y`): the builds run in parallel in a pool of build
processes (TensorRT parsing and building hold the GIL), TRTFORGE_JOBS of them (default: the CPU count).

Every configuration is composed and checked first (bad input: exit 2 before any work). Up-to-date builds are
answered here. The stages the builds share (export, partition, the Q/DQ graph per precision) are computed once:
the first build to need a cache entry computes it under the entry's lock, the others wait and reuse it. The workers
report to one Prefect server (PREFECT_API_URL, or the machine's shared local one, flows/local/server.py).
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from typing import Callable

from flows.cache import build_key
from flows.config import compose_config, preflight
from tasks.common import TrtforgeError, cause


def jobs(n: int) -> int:
    return max(1, min(n, int(os.environ.get("TRTFORGE_JOBS") or os.cpu_count() or 1)))


def _worker_build(run_build: Callable, overrides: list[str], config_dir: str | None) -> dict:
    """One build in a pool process: the summary, or the error it ended with (rendered, with its exit code)."""
    t0 = time.perf_counter()
    try:
        summary = run_build(compose_config(overrides, config_dir), config_dir, show_progress=False, overrides=overrides)
        return {"summary": summary, "seconds": time.perf_counter() - t0}
    except TrtforgeError as e:
        return {"error": e.render(), "exit_code": e.exit_code, "overrides": overrides}
    except Exception as e:  # a bug or an environment failure: short, non-zero
        return {"error": f"internal error: {type(e).__name__}: {cause(e)}", "exit_code": 1, "overrides": overrides}


def _die_with_parent() -> None:
    """A worker ends when the build that started it ends, however it ends (SIGTERM, SIGKILL): Linux's
    PR_SET_PDEATHSIG, in its own process or forked from a warm one alike."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def run_sweep(combos: list[list[str]], config_dir: str | None, report: Callable[[dict], None],
              run_build: Callable, up_to_date: Callable) -> int:
    """Run the combinations in parallel with `run_build` (flows.build's, passed in: it is pickled by reference into
    the spawned workers); `up_to_date` answers the builds that have nothing to do. `report` gets each worker's result
    as it finishes. Returns the exit status."""
    work, code = [], 0
    for ov in combos:  # bad input is reported before any heavy work; the other combinations still build
        try:
            cfg = compose_config(ov, config_dir)
            done = up_to_date(cfg, build_key(cfg, config_dir))
            if done is None:
                preflight(cfg, config_dir)
        except TrtforgeError as e:
            report({"error": e.render(), "exit_code": e.exit_code, "overrides": ov})
            code = max(code, e.exit_code)
            continue
        if done is not None:
            report({"summary": done, "seconds": 0.0})
        else:
            work.append(ov)
    if not work:
        return code
    from flows.local import server as prefect_server

    prefect_server.ensure()  # the workers report to the machine's shared local server (PREFECT_API_URL is inherited)
    context = get_context("spawn")  # fresh interpreters, in a warm build process too
    with prefect_server.lease(), ProcessPoolExecutor(jobs(len(work)), mp_context=context,
                                                     initializer=_die_with_parent) as pool:
        for f in as_completed([pool.submit(_worker_build, run_build, ov, config_dir) for ov in work]):
            r = f.result()
            report(r)
            code = max(code, r.get("exit_code", 0 if r.get("summary", {}).get("status") == "ok" else 1))
    return code
