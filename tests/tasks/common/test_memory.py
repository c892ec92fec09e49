"""A build's resident memory (tasks/common/memory.py): a stage's peak counts its child processes and native peaks
between samples, and a stage that passes the budget is stopped with an error naming the stage and the budget."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from tasks.common.memory import MIB, Budget, MemoryBudgetError, MemoryWatch, budget_from_config, host_available_mib


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def in_a_fresh_process(name: str, module: str = __name__) -> None:
    """Run ``module.name()`` in a process of its own: a build's memory counts every process it started, and a test
    inside the suite shares its process with the servers and trackers other tests left running."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    r = subprocess.run([sys.executable, "-c", f"from {module} import {name}; {name}()"], cwd=repo,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]


def test_a_stage_peak_counts_its_children_and_a_peak_between_samples():
    in_a_fresh_process("stage_peak_counts_children")


def stage_peak_counts_children():
    w = MemoryWatch(None).start()
    try:
        base = _rss()
        child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(200 << 20); b[::4096] = b'x' * "
                                  "len(b[::4096]); print('touched', flush=True); time.sleep(3)"],
                                 stdout=subprocess.PIPE, text=True)
        with w.stage("a"):
            a = np.ones(300 * MIB // 8)  # 300 MiB, touched, freed at once: only the high-water mark sees it
            del a
            assert child.stdout.readline().strip() == "touched"  # the child holds its 200 MiB from here
            time.sleep(1.0)  # several samples while it does, however loaded the host
            child.wait()
            child.stdout.close()
        with w.stage("b"):
            pass
    finally:
        w.close()
    a_peak, b_peak = w.stage_peaks["a"] - base, w.stage_peaks["b"] - base
    assert a_peak > 450 * MIB, a_peak / MIB  # 300 in this process + 200 in the child, less what it had not touched yet
    assert b_peak < 100 * MIB, b_peak / MIB  # the next stage starts from its own high-water mark
    assert w.peak >= w.stage_peaks["a"]


def test_a_stage_past_the_budget_is_stopped_naming_the_stage_and_the_budget():
    in_a_fresh_process("stage_past_the_budget_is_stopped")


def stage_past_the_budget_is_stopped():
    w = MemoryWatch(Budget(int(_rss() / MIB) + 200, "memory_budget_mib")).start()
    held = []
    try:
        with pytest.raises(MemoryBudgetError) as e:
            with w.stage("partition"):
                for _ in range(100):  # up to 1 GiB, 20 MiB at a time: stopped long before
                    held.append(np.ones(20 * MIB // 8))
                    time.sleep(0.02)
    finally:
        w.close()
    assert len(held) < 60, len(held)
    assert e.value.exit_code == 1 and e.value.stage == "partition"
    assert "the partition stage passed the build's memory budget" in e.value.message
    assert f"memory budget of {w.budget.mib} MiB (memory_budget_mib)" in e.value.message
    assert "memory_budget_mib=" in e.value.fix
    held.clear()
    with w.stage("validate"):  # the stop is not delivered to a later stage
        time.sleep(0.5)


def test_the_default_budget_is_a_share_of_what_the_host_has_available():
    b = budget_from_config(None)
    avail = host_available_mib()
    assert b is not None and 0.5 * avail < b.mib < avail and "available" in b.source
    assert budget_from_config(3000) == Budget(3000, "memory_budget_mib")
