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
        child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(200 << 20); b[::4096] = b'x' * "
                                  "len(b[::4096]); print('touched', flush=True); time.sleep(10)"],
                                 stdout=subprocess.PIPE, text=True)
        with w.stage("a"):
            base = _rss()  # after the stage gave back what earlier work freed: the peak is measured from here
            a = np.ones(300 * MIB // 8)  # 300 MiB, touched, freed at once: only the high-water mark sees it
            del a
            assert child.stdout.readline().strip() == "touched"  # the child holds its 200 MiB from here
            # until a sample taken from here has seen it beside this process's high-water mark (one taken while the
            # 300 MiB were still being filled saw less of them), however loaded the host
            with w._lock:
                w._children = 0
            deadline = time.monotonic() + 60
            while w._children < 200 * MIB and time.monotonic() < deadline and child.poll() is None:
                time.sleep(0.05)
            child.kill()
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


def test_a_stop_names_what_the_stage_was_doing():
    in_a_fresh_process("stop_names_the_activity")


def stop_names_the_activity():
    """validate runs one feed at a time under ``activity``: a stop at the budget names the feed and its inputs."""
    import numpy as np

    from tasks.common.memory import activity
    from tasks.evaluate.validate import feed_text

    w = MemoryWatch(Budget(int(_rss() / MIB) + 200, "memory_budget_mib")).start()
    held = []
    feed = {"tokens": np.zeros((1, 64), np.int64), "speed": np.array([0.0123456], np.float32)}
    try:
        with pytest.raises(MemoryBudgetError) as e:
            with w.stage("validate"):
                with activity(f"running the candidate on validation feed 3 of 9 ({feed_text(feed)})"):
                    for _ in range(100):
                        held.append(np.ones(20 * MIB // 8))
                        time.sleep(0.02)
    finally:
        w.close()
    assert "passed the build's memory budget" in e.value.message
    assert e.value.message.endswith("while running the candidate on validation feed 3 of 9 (tokens [1, 64], "
                                    "speed=[0.0123])"), e.value.message


def test_a_lower_bound_over_the_budget_is_refused_near_it_warned_and_far_below_it_silent():
    from tasks.common import ConfigError
    from tasks.common.memory import WARN_SHARE, Estimate, fit_check

    e = Estimate(resident=300 * MIB, weights=1000 * MIB, weights_what="m.onnx", step=500 * MIB,
                 step_what="the largest step", step_key="model.profiles[0]")  # 2800 MiB
    with pytest.raises(ConfigError) as refused:
        fit_check(e, Budget(2700, "memory_budget_mib"), file="/models/m.onnx")
    err = refused.value
    assert err.exit_code == 2 and err.file == "/models/m.onnx"
    assert err.message.startswith("model.source: this build needs at least 2800 MiB, more than its memory budget of "
                                  "2700 MiB (memory_budget_mib): the model's weights (m.onnx: 1000 MiB) held 2 times")
    assert "memory_budget_mib=3501" in err.fix and "host with more memory" in err.fix
    assert "lower the max shapes of model.profiles[0]" in err.fix
    step_first = Estimate(300 * MIB, 10 * MIB, "m.onnx", 5000 * MIB, "the largest step", "model.profiles[1]")
    with pytest.raises(ConfigError, match=r"^model\.profiles\[1\]: this build needs at least 5320 MiB"):
        fit_check(step_first, Budget(4000, "memory_budget_mib"))
    warning = fit_check(e, Budget(int(2800 / WARN_SHARE) - 10, "memory_budget_mib"))
    assert warning is not None and "this build needs at least 2800 MiB" in warning and "memory_budget_mib=N" in warning
    assert fit_check(e, Budget(int(2800 / WARN_SHARE) + 10, "memory_budget_mib")) is None
    assert fit_check(e, None) is None  # a host that does not say: nothing to check against
