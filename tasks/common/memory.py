"""A build's resident memory: its peak per stage and over the whole build, and the budget it stays within.

What is measured: the resident set (RSS) of this process and of its descendants in its session (the MLflow tracker, a
sweep's workers; the shared local Prefect server runs in a session of its own and serves other builds too, so it is not
counted), sampled every SAMPLE_SECONDS, and never less than this process's own high-water mark (VmHWM, reset at each
stage's start) plus its descendants' last sample: a peak of native code between two samples still counts.

The budget (``memory_budget_mib``; by default BUDGET_SHARE of the memory the host has available when the build starts)
is enforced while a stage runs: a stage that passes it is stopped with a MemoryBudgetError naming the stage and the
budget (a failed build, exit 1). A stage stuck in native code that cannot be stopped (still over the budget
GRACE_SECONDS later, or past HARD_SHARE of it) ends the process with that message before it exhausts the host; so
does a build over its budget between stages when the host has less than HOST_FLOOR_SHARE of its memory left.

Before any heavy stage, ``fit_check`` compares a lower bound of the build's peak (``Estimate``: what its processes held
before the model was read, the model's weights held twice, the largest step at the profiles' max shapes; tasks/graph/footprint.py) with
the budget: a build that surely cannot fit is refused as bad input (exit 2, no MLflow run), one near it is warned about.
While a stage runs, ``activity`` names what it is doing (e.g. the validation feed, its inputs), and a stop says so.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from tasks.common.errors import ConfigError, StageError

MIB = 1 << 20
BUDGET_SHARE = 0.75  # of MemAvailable at the build's start, when memory_budget_mib is not set
SAMPLE_SECONDS = 0.2
GRACE_SECONDS = 20.0  # a stage told to stop that is still over budget this long after ends the process
HARD_SHARE = 1.25  # past this share of the budget the process ends at once (memory grows faster than a stage stops)
HOST_FLOOR_SHARE = 0.05  # between stages, a build over its budget ends when the host has less than this share left
WEIGHT_COPIES = 2  # a build holds the model's graph and ONNX Runtime's copy of its weights at least
# measured peaks over the bound (zoo models and synthetic MatMul chains, fp32/fp16/int8; benchmarks/zoo/RESULTS.md)
PEAK_OVER_BOUND = (1.5, 13.7)
WARN_SHARE = 1 / PEAK_OVER_BOUND[0]  # a bound past this share of the budget is near it: its peak is likely over
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class MemoryBudgetError(StageError):
    """A stage passed the build's memory budget and was stopped."""


class _Stop(BaseException):
    """Raised in a stage's thread by the watchdog (a BaseException: a stage's own ``except Exception`` does not keep
    it running); the stage's context turns it into MemoryBudgetError."""


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in MiB ({} where there is none)."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) // 1024
    except OSError:
        pass
    return out


def host_available_mib() -> int | None:
    """The memory the host can give now without swapping (MemAvailable), in MiB; None where it is not known."""
    return _meminfo().get("MemAvailable")


def host_total_mib() -> int | None:
    return _meminfo().get("MemTotal")


@dataclass(frozen=True)
class Budget:
    mib: int
    source: str  # how it was chosen, said in the summary and in the error

    def as_dict(self) -> dict:
        return {"budget_mib": self.mib, "budget_source": self.source}


def budget_from_config(configured: int | None) -> Budget | None:
    """The budget of a build: ``configured`` (memory_budget_mib) when set, else BUDGET_SHARE of the host's available
    memory now; None where the host does not say (no /proc/meminfo)."""
    if configured:
        return Budget(int(configured), "memory_budget_mib")
    avail = host_available_mib()
    if avail is None:
        return None
    return Budget(int(avail * BUDGET_SHARE), f"{BUDGET_SHARE:.0%} of the {avail} MiB the host had available when the "
                                             "build started (set memory_budget_mib to choose)")


@dataclass(frozen=True)
class Estimate:
    """A lower bound of a build's peak resident memory, from what is known before it runs (bytes). ``weights_what``
    names the files, ``step_what`` the largest step (None where shape inference knows no step at the max shapes, or
    no stage runs the model at them)."""
    resident: int  # this build's processes before the model is read (measured): held through every stage
    weights: int  # the model file and its external data
    weights_what: str
    step: int = 0  # the largest step's inputs and outputs at a profile's max shapes
    step_what: str | None = None
    step_key: str | None = None  # the config key that sets that shape (model.profiles[k])
    weights_key: str = "model.source"  # the config key that names the model (model.factory for a torch model)

    @property
    def total(self) -> int:
        return self.resident + WEIGHT_COPIES * self.weights + self.step

    def parts(self) -> str:
        return (f"the model's weights ({self.weights_what}: {_mib(self.weights):.0f} MiB) held {WEIGHT_COPIES} times "
                f"(the graph and ONNX Runtime's copy), {_mib(self.resident):.0f} MiB this build's processes held "
                "before reading the model" + (f", and {_mib(self.step):.0f} MiB for {self.step_what}"
                                              if self.step_what else ""))

    def as_dict(self) -> dict:
        """For summary.json ``memory``: estimated (a lower bound), never a measurement."""
        return {"estimate_mib": round(_mib(self.total)), "estimate": "a lower bound from the model's files and static "
                "shapes, before any stage ran: " + self.parts()}


def fit_check(estimate: Estimate, budget: Budget | None, file: str | None = None) -> str | None:
    """Refuse (ConfigError, exit 2) a build whose lower bound ``estimate`` is over ``budget``; a warning when it is
    past WARN_SHARE of it (its real peak is likely over); None otherwise."""
    if budget is None:
        return None
    need = estimate.total
    if need > budget.mib * MIB:
        total = host_total_mib()
        more = f"memory_budget_mib={int(_mib(need) * 1.25) + 1}" if total is None or _mib(need) * 1.25 < total else None
        fixes = ([f"give it more with {more}"] if more else []) + ["build on a host with more memory"] + (
            [f"lower the max shapes of {estimate.step_key}"] if estimate.step_key and estimate.step else [])
        key = estimate.weights_key if WEIGHT_COPIES * estimate.weights >= estimate.step else estimate.step_key
        raise ConfigError(
            f"{key}: this build needs at least {_mib(need):.0f} MiB, more than its memory budget of {budget.mib} "
            f"MiB ({budget.source}): {estimate.parts()}",
            file=file, fix=", or ".join(fixes) + f" (a lower bound: builds peaked at {_ratios()} of theirs)")
    if need > budget.mib * MIB * WARN_SHARE:
        return (f"this build needs at least {_mib(need):.0f} MiB ({estimate.parts()}), {need / (budget.mib * MIB):.0%} of "
                f"its memory budget of {budget.mib} MiB ({budget.source}); builds peaked at {_ratios()} of such a "
                "bound, so it may be stopped at the budget: give it more with memory_budget_mib=N, or build on a "
                "larger host")
    return None


def _ratios() -> str:
    return f"{PEAK_OVER_BOUND[0]:g}-{PEAK_OVER_BOUND[1]:g}x"


def release_freed_memory() -> None:
    """Give the memory freed so far back to the host (glibc's malloc_trim; nothing elsewhere): values of tens of MiB
    freed by numpy and ONNX Runtime stay in malloc's heaps otherwise, and a stage that runs large feeds one after
    another grows by them."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def resident_bytes() -> int:
    """The resident memory of this process and its descendants in its session now (bytes)."""
    return sum(r for _, r in _tree(os.getpid()))


_activity: list[str] = []  # what the running stage is doing, innermost last (said when it is stopped)


@contextlib.contextmanager
def activity(what: str):
    """Name what a stage is doing (e.g. ``validation feed 3 of 9: speed=[0.02], tokens [1, 64]``): a stage stopped
    at the budget meanwhile says it, so the error names the input that took the memory."""
    _activity.append(what)
    try:
        yield
    finally:
        _activity.pop()


def _tree(root: int) -> list[tuple[int, int]]:
    """(pid, RSS bytes) of ``root`` and its descendants in root's session."""
    kids: dict[int, list[int]] = defaultdict(list)
    info: dict[int, tuple[int, int]] = {}  # pid -> (session, rss bytes)
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rindex(b")") + 2:].split()
        pid = int(d)
        kids[int(rest[1])].append(pid)
        info[pid] = (int(rest[3]), int(rest[21]) * _PAGE)
    if root not in info:
        return []
    session, out, todo = info[root][0], [], [root]
    while todo:
        pid = todo.pop()
        if pid in info and (pid == root or info[pid][0] == session):
            out.append((pid, info[pid][1]))
            todo.extend(kids.get(pid, ()))
    return out


def _own_hwm() -> int | None:
    """This process's resident high-water mark (VmHWM) in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_own_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _mib(b: float) -> float:
    return round(b / MIB, 1)


@dataclass
class MemoryWatch:
    """Samples the build's processes in a thread from start() to close(); ``stage(name)`` measures one stage and
    enforces the budget while it runs."""
    budget: Budget | None
    peak: int = 0  # bytes, over the whole watch
    stage_peaks: dict[str, int] = field(default_factory=dict)
    _root: int = field(default_factory=os.getpid)
    _current: tuple[str, int] | None = None  # (stage, thread id) of the stage running
    _stage_peak: int = 0
    _children: int = 0  # the descendants' RSS at the last sample
    _stop_sent: float | None = None
    _breach: tuple[str, int, str | None] | None = None  # (stage, bytes, activity) that passed the budget
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> "MemoryWatch":
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="trtforge-memory", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._sample()

    @property
    def peak_mib(self) -> float:
        return _mib(self.peak)

    def stage_peak_mib(self, name: str) -> float | None:
        return _mib(self.stage_peaks[name]) if name in self.stage_peaks else None

    @contextlib.contextmanager
    def stage(self, name: str):
        """Measure stage ``name`` (its peak in stage_peaks) and stop it with MemoryBudgetError when it passes the
        budget. It starts with the memory earlier stages freed given back to the host."""
        release_freed_memory()
        _reset_own_hwm()
        with self._lock:
            self._current, self._stage_peak, self._breach, self._stop_sent = (name, threading.get_ident()), 0, None, None
        total = self._sample()
        if self.budget is not None and total > self.budget.mib * MIB:  # over it already: the stage does not start
            with self._lock:
                self._current = None
            self.stage_peaks[name] = max(self.stage_peaks.get(name, 0), self._stage_peak)
            raise self.error(name, total, starting=True)
        stopped = False
        try:
            yield
        except _Stop:
            stopped = True
        finally:
            with self._lock:
                self._current = None
                if self._stop_sent is not None:  # told to stop but ended first: the stop is not delivered later
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.get_ident()), None)
                breach = self._breach
            self._sample(final=True)
            self.stage_peaks[name] = max(self.stage_peaks.get(name, 0), self._stage_peak)
        if stopped or breach is not None:
            raise self.error(name, breach[1] if breach else self._stage_peak, doing=breach[2] if breach else None) from None

    def error(self, stage: str, used: int, starting: bool = False, doing: str | None = None) -> MemoryBudgetError:
        b = self.budget
        avail = host_available_mib()
        what = (f"the {stage} stage did not start: this build's processes already hold {_mib(used):.0f} MiB, over "
                if starting else f"the {stage} stage passed the build's memory budget with {_mib(used):.0f} MiB "
                                 "resident in this build's processes and was stopped before it exhausts the host: ")
        doing = f" while {doing}" if doing else ""
        return MemoryBudgetError(
            f"{what}the memory budget of {b.mib} MiB ({b.source}){doing}",
            stage=stage, fix=f"give the build more memory with memory_budget_mib=N (the host has {avail} MiB available "
                             "now), or build on a host with more memory" + (
                                 "; a model cut into many TensorRT subgraphs needs less with fewer of them "
                                 "(partition.min_subgraph_size)" if stage in ("partition", "build") else ""))

    def _sample(self, final: bool = False) -> int:
        tree = _tree(self._root)
        total = sum(r for _, r in tree)
        children = total - next((r for p, r in tree if p == self._root), 0)
        hwm = _own_hwm()
        with self._lock:
            self._children = children
            seen = max(total, (hwm or 0) + children) if self._current is not None or final else total
            self.peak = max(self.peak, seen)
            if self._current is not None or final:
                self._stage_peak = max(self._stage_peak, seen)
        return total

    def _loop(self) -> None:
        while not self._done.wait(SAMPLE_SECONDS):
            try:
                total = self._sample()
            except Exception:  # a process ended between listing and reading: the next sample sees the tree again
                continue
            if self.budget is not None and total > self.budget.mib * MIB:
                self._enforce(total)

    def _enforce(self, total: int) -> None:
        """Over the budget: stop the stage running (once); end the process when it cannot be stopped."""
        with self._lock:
            current = self._current
            if current is not None and self._stop_sent is None:
                self._breach = (current[0], total, _activity[-1] if _activity else None)
                self._stop_sent = time.monotonic()
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(current[1]), ctypes.py_object(_Stop))
                return
            sent = self._stop_sent
        if current is None:  # between stages (a failure being published): nothing heavy runs, unless the host runs out
            avail, host = host_available_mib(), host_total_mib()
            if avail is not None and host and avail < host * HOST_FLOOR_SHARE and total > self.budget.mib * MIB:
                self._end_process("publish", total)
            return
        if total > self.budget.mib * MIB * HARD_SHARE or (sent is not None and time.monotonic() - sent > GRACE_SECONDS):
            self._end_process(current[0], total)

    def _end_process(self, stage: str, total: int) -> None:
        """The last resort: the stage is in native code and memory keeps growing. Say why, end the build's
        descendants and this process (exit 1, as a failed build)."""
        doing = _activity[-1] if _activity else None
        sys.stderr.write(f"trtforge: {self.error(stage, total, doing=doing).render()}\n  (the stage could not be "
                         "stopped in time: the process ended without publishing a result)\n")
        sys.stderr.flush()
        for pid, _ in _tree(self._root):
            if pid != self._root:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        os._exit(1)
