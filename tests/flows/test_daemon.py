"""The warm build process (flows/local/daemon.py): after a first CLI build, later ones are served by a process that has
everything imported; exit codes, messages and output reach the caller as before, Ctrl-C reaches the build, and a
killed CLI takes its build (and what the build started) with it. Real CLI processes, real builds."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from flows.local.daemon import identity, socket_path
from flows.local.server import pid_alive


@pytest.fixture(scope="module")
def warm(tmp_path_factory, user_config_dir):
    tmp = tmp_path_factory.mktemp("daemon")
    env = {**os.environ, "TRTFORGE_DAEMON": "1", "TRTFORGE_DAEMON_IDLE": "120", "TRTFORGE_TEST": uuid.uuid4().hex,
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"}  # an identity of its own: no other daemon serves it
    env.pop("PREFECT_API_URL", None)
    sock = socket_path(identity(env))
    w = (tmp, user_config_dir, env, sock)
    first = cli(w, "precision=fp32")  # no warm process yet: the first build runs in its own process ...
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert not served(sock)
    wait_for(sock.exists, 120, "no warm process came up after the first build")  # ... and leaves a warm one behind
    yield w
    sock.unlink(missing_ok=True)  # the daemon exits within a second


def cli(warm, *extra: str, wait: bool = True, flags: tuple[str, ...] = ()):
    tmp, conf, env, _ = warm
    args = [sys.executable, "-m", "flows.build", *flags, "--config-dir", str(conf), "model=tiny", "stages.benchmark=false",
            f"out_dir={tmp / 'out'}", f"cache_dir={tmp / 'cache'}", *extra]
    if not wait:
        return subprocess.Popen(args, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    return subprocess.run(args, cwd=tmp, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)


def served(sock: Path, since: int = 0) -> list[int]:
    """Pids of the builds the daemon forked (its log), after the first `since` lines."""
    log = sock.with_suffix(".log")
    lines = log.read_text().splitlines()[since:] if log.exists() else []
    return [int(ln.split()[2].rstrip(":")) for ln in lines if " build " in ln]


def log_lines(sock: Path) -> int:
    log = sock.with_suffix(".log")
    return len(log.read_text().splitlines()) if log.exists() else 0


def wait_for(pred, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.slow
def test_after_a_first_build_the_cli_is_served_warm_with_the_same_results(warm):
    _, _, _, sock = warm
    n = log_lines(sock)
    second = cli(warm, "precision=fp16")
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert len(served(sock, n)) == 1  # this one was forked from the warm process
    assert "tiny → sm_86 fp16: ok in" in second.stdout and "mlflow   run " in second.stdout
    again = cli(warm, "precision=fp16")
    assert again.returncode == 0 and "up to date" in again.stdout

    bad = cli(warm, "precision=fp16", "accuracy.min_cosine=1.5")  # bad input: exit 2, the message, no traceback
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "accuracy.min_cosine" in bad.stderr and "Traceback" not in bad.stderr
    assert len(served(sock, n)) == 3


@pytest.mark.slow
def test_ctrl_c_reaches_the_build_and_a_killed_cli_takes_its_build_with_it(warm):
    _, _, _, sock = warm
    for how in (signal.SIGINT, signal.SIGKILL):
        n = log_lines(sock)
        target = "sm_80" if how == signal.SIGINT else "sm_89"
        # a benchmark of a million runs: the build is surely under way when the signal comes
        proc = cli(warm, "precision=fp16", f"target={target}", "stages.benchmark=true", "benchmark.iterations=1000000",
                   wait=False)
        wait_for(lambda: served(sock, n), 60, "the build was not handed to the warm process")
        child = served(sock, n)[0]
        time.sleep(3.0)
        assert pid_alive(child) and proc.poll() is None
        proc.send_signal(how)
        proc.wait(timeout=120)
        wait_for(lambda: not pid_alive(child) or _zombie(child), 30, f"the build outlived its CLI ({how.name})")
        tmp = warm[0]
        assert not (tmp / "out" / "tiny" / target / "fp16" / "summary.json").exists()  # it did not finish
        if how == signal.SIGINT:
            assert proc.returncode in (1, 130), (proc.returncode, proc.stderr.read()[-2000:])
        else:
            assert proc.returncode == -signal.SIGKILL


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # exited, not yet reaped by the daemon
    except OSError:
        return True


def test_a_warm_process_serves_one_environment_and_one_version_of_the_code():
    env = {"PATH": "/usr/bin", "PREFECT_HOME": "/a", "PWD": "/x", "COLUMNS": "80"}
    assert identity(env) == identity({**env, "PWD": "/y", "COLUMNS": "120"})  # the caller's shell is not the build's
    assert identity(env) != identity({**env, "PREFECT_HOME": "/b"})
    assert identity(env) != identity({**env, "MLFLOW_TRACKING_URI": "sqlite:///x.db"})


@pytest.mark.slow
def test_a_sweep_served_warm_forks_its_workers_from_the_warm_build(warm):
    tmp, _, _, sock = warm
    n = log_lines(sock)
    r = cli(warm, "precision=fp32,fp16", "target=sm_75,sm_120", flags=("-m",))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(served(sock, n)) == 1 and r.stdout.count(": ok in") == 4, r.stdout
    for t in ("sm_75", "sm_120"):
        for p in ("fp32", "fp16"):
            assert (tmp / "out" / "tiny" / t / p / "summary.json").is_file()
