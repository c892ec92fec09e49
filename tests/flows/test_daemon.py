"""The warm build process (flows/local/daemon.py), opt-in with TRTFORGE_DAEMON=1: after a first CLI build, later ones
are served by a process that has everything imported. One matrix runs every case both ways, in the CLI's own process
(cold) and served warm, and asks for the same results: exit codes, messages, Ctrl-C, Ctrl-Z, SIGTERM mid-build, a
killed CLI, a sweep. Real CLI processes, real builds, a real warm process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from flows.local import daemon
from flows.local.daemon import enabled, identity, socket_path
from flows.local.locks import pid_alive


@pytest.fixture(scope="module")
def warm(tmp_path_factory, user_config_dir):
    tmp = tmp_path_factory.mktemp("daemon")
    env = {**os.environ, "TRTFORGE_DAEMON": "1", "TRTFORGE_DAEMON_IDLE": "300", "TRTFORGE_TEST": uuid.uuid4().hex,
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"}  # an identity of its own: no other daemon serves it
    for k in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "CI"):
        env.pop(k, None)
    sock = socket_path(identity(env))
    w = (tmp, user_config_dir, env, sock)
    first = cli(w, "precision=fp32")  # no warm process yet: the first build runs in its own process ...
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert not served(sock)
    wait_for(sock.exists, 180, "no warm process came up after the first build")  # ... and leaves a warm one behind
    yield w
    sock.unlink(missing_ok=True)  # the daemon exits within a second


@pytest.fixture(scope="module")
def cold(tmp_path_factory, user_config_dir):
    """The same CLI, built in its own process every time (the default), with result folders of its own."""
    tmp = tmp_path_factory.mktemp("cold")
    env = {**os.environ, "TRTFORGE_DAEMON": "0", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"}
    for k in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING"):
        env.pop(k, None)
    return (tmp, user_config_dir, env, None)


def as_job(background: bool):
    """What a shell does to a job's signals before it runs it: an interactive shell's job (and a foreground one) takes
    Ctrl-C and Ctrl-\\; `cmd &` in a script ignores both. Set here, whatever this test process inherited: a suite run
    in the background (`make test &`) would otherwise start every build ignoring Ctrl-C."""
    disposition = signal.SIG_IGN if background else signal.SIG_DFL

    def preexec() -> None:
        for sig in (signal.SIGINT, signal.SIGQUIT):
            signal.signal(sig, disposition)
    return preexec


_started: list[subprocess.Popen] = []  # CLIs started without waiting: none outlives its test, whatever the test found


@pytest.fixture(autouse=True)
def no_build_outlives_its_test():
    yield
    while _started:
        p = _started.pop()
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(30)


def cli(w, *extra: str, wait: bool = True, flags: tuple[str, ...] = (), background: bool = False):
    tmp, conf, env, _ = w
    args = [sys.executable, "-m", "flows.build", *flags, "--config-dir", str(conf), "model=tiny", "stages.benchmark=false",
            f"out_dir={tmp / 'out'}", f"cache_dir={tmp / 'cache'}", *extra]
    if not wait:  # a process group of its own, as a shell runs a job: the test's Ctrl-C and Ctrl-Z go to the group
        _started.append(subprocess.Popen(args, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, process_group=0,
                                         preexec_fn=as_job(background)))
        return _started[-1]
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


def state(pid: int) -> str:
    """The process's state letter (R, S, T stopped, Z zombie); 'X' when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def descendants(pid: int) -> set[int]:
    """What the process started and still runs, but the shared Prefect server (a build that started it hands it on)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if b"flows.local.server" in (d / "cmdline").read_bytes():
                    continue
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def ended(proc: subprocess.Popen, seconds: float, what: str) -> None:
    """Wait for the CLI to end; if it does not, fail with where each of its threads waits (name, state, kernel wait
    channel): a Ctrl-C that never ends a build is told apart from a build that ignored it."""
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        threads = []
        for t in sorted(Path(f"/proc/{proc.pid}/task").glob("*")):
            try:
                name = (t / "comm").read_text().strip()
                st = (t / "stat").read_text().rsplit(")", 1)[1].split()[0]
                threads.append(f"{name}:{st}:{(t / 'wchan').read_text().strip() or '-'}")
            except OSError:
                continue
        raise AssertionError(f"{what}: not ended in {seconds:.0f} s; its threads: {', '.join(threads)}") from None


def gone(pids) -> bool:
    return all(state(p) in ("X", "Z") for p in pids)


def the_build(w, proc) -> tuple[int, set[int]]:
    """The build's process (the CLI itself, or the warm process's child) and what it started, once it is under way."""
    sock = w[3]
    if sock is None:
        build = proc.pid
    else:
        wait_for(lambda: served(sock, w[4]), 60, "the build was not handed to the warm process")
        build = served(sock, w[4])[0]
    return build, descendants(build)


def long_build(w, *extra: str, flags: tuple[str, ...] = (), background: bool = False):
    """An fp16 build with a benchmark of a million runs: under way when the test signals it."""
    w = (*w[:4], log_lines(w[3]) if w[3] else 0)
    proc = cli(w[:4], "precision=fp16", "stages.benchmark=true", "benchmark.iterations=1000000", *extra, wait=False,
               flags=flags, background=background)
    build, _ = the_build(w, proc)
    time.sleep(6.0)  # past the imports, into the stages
    assert proc.poll() is None, proc.stderr.read()[-2000:]
    return proc, build, descendants(build) | {build}


def tail(text: str) -> str:
    """The CLI's own last line (Prefect's log lines before it carry times and run names)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


MODES = ("cold", "warm")


@pytest.fixture(scope="module")
def both(cold, warm):
    return {"cold": cold, "warm": warm}


@pytest.mark.slow
def test_exit_codes_and_messages_are_the_same_warm_or_cold(both):
    results = {}
    for mode in MODES:
        w = both[mode]
        n = log_lines(w[3]) if w[3] else 0
        ok = cli(w, "precision=fp16")
        again = cli(w, "precision=fp16")
        bad = cli(w, "precision=fp16", "accuracy.min_cosine=1.5")  # bad input: exit 2, the message, no traceback
        unparsable = cli(w, "precision=[fp16")  # a SystemExit("message") in flows/cli.py
        sweep_without_m = cli(w, "precision=fp16,fp32")
        results[mode] = [(r.returncode, r.stderr.replace(str(w[0]), "TMP")) for r in (bad, unparsable, sweep_without_m)]
        assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
        assert "tiny → sm_86 fp16: ok in" in ok.stdout and "mlflow   run " in ok.stdout
        assert again.returncode == 0 and "up to date" in again.stdout
        if w[3]:
            assert len(served(w[3], n)) == 5  # every one of them was forked from the warm process
    assert results["warm"] == results["cold"]
    (bad_code, bad_err), (parse_code, parse_err), (sweep_code, sweep_err) = results["cold"]
    assert bad_code == 2 and "accuracy.min_cosine" in bad_err and "Traceback" not in bad_err
    assert parse_code == 1 and "cannot parse overrides" in parse_err
    assert sweep_code == 2 and "is a sweep" in sweep_err


@pytest.mark.slow
def test_ctrl_c_ctrl_z_and_sigterm_mid_build_end_it_the_same_way_warm_or_cold(both):
    outcome, said = {}, {}
    for mode in MODES:
        w = both[mode]
        # Ctrl-Z then Ctrl-C, as a terminal sends them: to the job's process group
        proc, build, procs = long_build(w, "target=sm_80")
        os.killpg(proc.pid, signal.SIGTSTP)
        wait_for(lambda: state(proc.pid) == "T" and state(build) == "T", 30, f"{mode}: Ctrl-Z did not stop the build")
        os.killpg(proc.pid, signal.SIGCONT)
        wait_for(lambda: state(build) not in ("T", "X"), 30, f"{mode}: the build did not continue")
        os.killpg(proc.pid, signal.SIGINT)
        ended(proc, 300, f"{mode}: Ctrl-C after Ctrl-Z and fg")
        wait_for(lambda: gone(procs), 60, f"{mode}: the build outlived Ctrl-C")
        interrupted = (proc.returncode, tail(proc.stderr.read()))
        said[mode] = proc.stdout.read()[-1500:]  # what the build printed, should it end otherwise
        # a job started with `&` from a script ignores Ctrl-C (its shell set SIGINT to ignored): so does its build;
        # `kill PID` (SIGTERM to the CLI alone) ends it
        proc, build, procs = long_build(w, "target=sm_89", background=True)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(3.0)
        assert proc.poll() is None and state(build) not in ("X", "Z"), f"{mode}: a build started ignoring Ctrl-C stopped"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
        wait_for(lambda: gone(procs), 60, f"{mode}: the build outlived SIGTERM")
        terminated = proc.returncode
        # a CLI killed outright takes its build with it
        proc, build, procs = long_build(w, "target=sm_75")
        proc.kill()
        proc.wait(timeout=60)
        wait_for(lambda: gone(procs), 60, f"{mode}: the build outlived its killed CLI")
        for t in ("sm_80", "sm_89", "sm_75"):
            assert not (w[0] / "out" / "tiny" / t / "fp16" / "summary.json").exists()  # none of them finished
        outcome[mode] = (interrupted, terminated, proc.returncode)
    assert outcome["warm"] == outcome["cold"], said
    assert outcome["cold"] == ((-signal.SIGINT, "trtforge: stopped by SIGINT"), -signal.SIGTERM, -signal.SIGKILL), said


@pytest.mark.slow
def test_a_sweep_runs_and_stops_the_same_warm_or_cold(both):
    for mode in MODES:
        w = both[mode]
        n = log_lines(w[3]) if w[3] else 0
        r = cli(w, "precision=fp32,fp16", "target=sm_75,sm_120", flags=("-m",))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert r.stdout.count(": ok in") == 4, r.stdout
        for t in ("sm_75", "sm_120"):
            for p in ("fp32", "fp16"):
                assert (w[0] / "out" / "tiny" / t / p / "summary.json").is_file()
        if w[3]:
            assert len(served(w[3], n)) == 1  # one request; its workers were forked from the warm build
        # SIGTERM to the CLI mid-sweep: the workers go with the build, whichever process it ran in
        proc, build, _ = long_build(w, "target=sm_80,sm_86", flags=("-m",))
        wait_for(lambda: len(descendants(build)) >= 2, 60, f"{mode}: the sweep's workers did not start")
        procs = descendants(build) | {build}
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        assert proc.returncode == -signal.SIGTERM, (mode, proc.returncode, proc.stderr.read()[-2000:])
        wait_for(lambda: gone(procs), 60, f"{mode}: the sweep's workers outlived SIGTERM")


def test_the_warm_process_is_opt_in_and_never_under_ci():
    assert not enabled({})  # off by default
    assert enabled({"TRTFORGE_DAEMON": "1"})
    assert not enabled({"TRTFORGE_DAEMON": "0"})
    assert not enabled({"TRTFORGE_DAEMON": "1", "CI": "true"})
    assert enabled({"TRTFORGE_DAEMON": "1", "CI": ""})


def test_a_warm_process_serves_what_shapes_a_build_not_every_variable():
    env = {"PATH": "/usr/bin", "PREFECT_HOME": "/a", "PWD": "/x", "COLUMNS": "80"}
    assert identity(env) == identity({**env, "PWD": "/y", "COLUMNS": "120"})  # the caller's shell is not the build's
    assert identity(env) == identity({**env, "CI_JOB_ID": "4711", "GITHUB_RUN_ID": "9"})  # nor a CI job's ids
    assert identity(env) == identity({**env, "TRTFORGE_TRACEBACK": "1", "TRTFORGE_DAEMON_IDLE": "5"})
    assert identity(env) != identity({**env, "PREFECT_HOME": "/b"})
    assert identity(env) != identity({**env, "MLFLOW_TRACKING_URI": "sqlite:///x.db"})
    assert identity(env) != identity({**env, "OPENBLAS_NUM_THREADS": "1"})


def test_starting_one_more_warm_process_stops_the_least_recently_used(tmp_path, monkeypatch):
    """The cap per user: real listening sockets in a private runtime folder; the oldest by use loses its name (a
    warm process without its socket exits within a second)."""
    import socket

    rt = tmp_path / "run"
    rt.mkdir(mode=0o700)
    monkeypatch.setattr(daemon, "MAX_PER_USER", 2)
    listeners, paths = [], []
    for i in range(3):
        p = rt / f"ident{i}.sock"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(p))
        s.listen(1)
        os.utime(p, (1000 + i, 1000 + i), follow_symlinks=False)  # ident0 used longest ago
        listeners.append(s)
        paths.append(p)
    daemon._make_room(rt, keep=rt / "new.sock")
    assert [p.exists() for p in paths] == [False, False, True]  # room for the new one: two at most
    for s in listeners:
        s.close()


def test_the_warm_process_counts_native_threads_not_only_pythons():
    """OpenBLAS starts its worker threads when numpy is imported: native threads threading.active_count() does not see
    (ONNX Runtime's import starts one too, but not in every environment: none with CI set)."""
    code = ("import threading; from flows.local.daemon import threads; a = threads(); import numpy; "
            "print(a, threads(), threading.active_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OPENBLAS_NUM_THREADS": "2"}).stdout.split()
    before, after, python = map(int, out)
    assert python == 1 and after > before, out


@pytest.mark.slow
def test_a_stalled_client_does_not_hold_up_the_next_build_and_an_idle_warm_process_holds_no_lease(warm):
    """A connection that never sends its request is dropped after a few seconds while later builds are served; the
    warm process between builds holds no lease on the Prefect server (its idle timer runs)."""
    import socket as sockets

    tmp, _, env, sock = warm
    pid = int(sock.with_suffix(".pid").read_text())
    stalled = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    stalled.connect(str(sock))
    try:
        n = log_lines(sock)
        t0 = time.monotonic()
        r = cli(warm, "precision=fp32")  # up to date: a quick one
        assert r.returncode == 0 and "up to date" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
        assert len(served(sock, n)) == 1 and time.monotonic() - t0 < 60
        stalled.settimeout(30)
        assert stalled.recv(10) == b""  # dropped, never answered
    finally:
        stalled.close()
    home = Path(env.get("PREFECT_HOME") or Path.home() / ".prefect")
    assert not (home / "trtforge-leases" / str(pid)).exists()
    assert pid_alive(pid)
