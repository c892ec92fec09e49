"""The warm build process (opt-in: TRTFORGE_DAEMON=1, never under CI): `python -m flows.build` hands its build to a
process that has Prefect, MLflow, ONNX, ONNX Runtime and TensorRT imported already, instead of importing them again.

Like Gradle's daemon or a zygote: with TRTFORGE_DAEMON=1, the first CLI build runs in its own process and, once done,
starts `python -m flows.local.warm IDENTITY` detached (the warm process itself); it imports
everything once, with Prefect pointed at the user's shared local server (flows/local/server.py), and waits on a Unix
socket in the user's private runtime folder (flows/local/private.py: $XDG_RUNTIME_DIR/trtforge, else
~/.cache/trtforge/run; owned by the user, mode 0700, checked with lstat before every use; a folder that is not private
is refused with a one-line warning and the build runs in its own process). Both ends check the other's uid
(SO_PEERCRED): only the user's own processes are served, and a CLI talks only to its own user's warm process. A
request carries the build CLI's arguments, working directory, environment, start time and the caller's
stdin/stdout/stderr; the warm process runs nothing else (one fixed entry: flows.build's CLI). It forks; the child runs
the CLI exactly as a cold process would (flows.cli.finish: same output, exit status, SystemExit messages, death by the
same signal), writing to the caller's terminal, in a process group of its own. The CLI forwards SIGINT, SIGTERM,
SIGHUP, SIGQUIT and SIGTSTP/SIGCONT to that group (a sweep's workers too); the warm process reports how the child
ended ("exit N" or "signal N") and the CLI ends the same way. When the CLI goes (even by SIGKILL), the warm process
kills the build's group.

A warm process serves one interpreter, one version of trtforge's code, one set of installed packages and the
environment variables that shape a build (an allowlist: PREFECT_*, MLFLOW_*, TRTFORGE_*, CUDA/TensorRT/thread-pool
settings, HOME, TMPDIR, ...; not a CI job id or a terminal's variables). At most TRTFORGE_DAEMON_MAX (3) run per
user: starting another stops the least recently used. Each exits after TRTFORGE_DAEMON_IDLE seconds without builds
(default TRTFORGE_SERVER_IDLE, 600), and holds no lease on the Prefect server while idle. It forks only while it has
exactly one thread (counted in /proc/self/task: native pools too), which it keeps by importing with OpenBLAS at one
thread and Arrow's jemalloc without its background thread (the child restores the BLAS thread count a cold process
would have). Standard library only on the CLI's side (this module), so that it costs a few milliseconds.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from flows.local import private
from flows.local.termination import die_by

ROOT = Path(__file__).resolve().parents[2]
IDLE_SECONDS = float(os.environ.get("TRTFORGE_DAEMON_IDLE") or os.environ.get("TRTFORGE_SERVER_IDLE") or "600")
MAX_PER_USER = max(1, int(os.environ.get("TRTFORGE_DAEMON_MAX") or "3"))
REQUEST_SECONDS = 5.0  # a connected client sends its request at once: one that stalls is dropped, not waited for
ENTRY = "flows.build"  # the one thing a warm process runs: the build CLI (flows.build.cli)

# what shapes a build made in a warm process: read while it imports (Prefect's settings, library loading, thread
# pools, caches and temp folders) or at its start; everything else reaches the build with the caller's environment
SHAPING_PREFIXES = ("TRTFORGE_", "PREFECT_", "MLFLOW_", "HYDRA_", "CUDA_", "NVIDIA_", "TRT_", "TENSORRT_",
                    "POLYGRAPHY_", "ORT_", "OMP_", "OPENBLAS_", "GOTO_", "MKL_", "PYTHON")
SHAPING_NAMES = ("HOME", "LD_LIBRARY_PATH", "LD_PRELOAD", "TMPDIR", "TEMP", "TMP", "XDG_CACHE_HOME", "XDG_CONFIG_HOME",
                 "XDG_RUNTIME_DIR", "DO_NOT_TRACK", "MPLBACKEND", "MPLCONFIGDIR", "TZ", "LANG", "LC_ALL", "LC_CTYPE",
                 "JE_ARROW_MALLOC_CONF", "ARROW_DEFAULT_MEMORY_POOL")
# read by the build at run time from the caller's environment (sent with every request), or only by the CLI's side
NOT_SHAPING = ("TRTFORGE_DAEMON", "TRTFORGE_DAEMON_IDLE", "TRTFORGE_DAEMON_MAX", "TRTFORGE_TIMELINE",
               "TRTFORGE_TRACEBACK", "TRTFORGE_JOBS", "PYTHONUNBUFFERED")


def enabled(env=None) -> bool:
    """TRTFORGE_DAEMON=1 (or true/yes/on) turns it on; never under CI (any CI value but ''/0/false/no)."""
    env = os.environ if env is None else env
    if env.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        return False
    return env.get("TRTFORGE_DAEMON", "").strip().lower() in ("1", "true", "yes", "on")


def shapes(name: str) -> bool:
    return name not in NOT_SHAPING and (name in SHAPING_NAMES or name.startswith(SHAPING_PREFIXES))


def identity(env=None) -> str:
    """What a warm process depends on: interpreter, trtforge's code (size and mtime of every module), the installed
    packages (site-packages' mtime changes with every install) and the variables that shape a build (shapes())."""
    env = dict(os.environ if env is None else env)
    h = hashlib.sha256(sys.executable.encode())
    for d in ("flows", "tasks"):
        for f in sorted((ROOT / d).rglob("*.py")):
            st = f.stat()
            h.update(f"{f.relative_to(ROOT)}:{st.st_size}:{st.st_mtime_ns}".encode())
    for p in sys.path:
        if p.endswith("site-packages") and os.path.isdir(p):
            h.update(f"{p}:{os.stat(p).st_mtime_ns}".encode())
    h.update(json.dumps({k: v for k, v in sorted(env.items()) if shapes(k)}).encode())
    return h.hexdigest()[:20]


def socket_path(ident: str) -> Path:
    """Where the warm process of this identity listens (in the private runtime folder; not checked here)."""
    return private.runtime_dir() / f"{ident}.sock"


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket, as the kernel says (SO_PEERCRED)."""
    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def threads() -> int:
    """This process's threads as the kernel counts them (native pools included, not only Python's)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


# --- the CLI's side --------------------------------------------------------------------------------------------

class Refused(Exception):
    """A socket or folder that is not this user's own: nothing is sent to it."""


def delegate(argv: list[str]) -> int | None:
    """Run the build CLI with argv in this user's warm process: its exit status (or this process dies by the signal
    that ended the build), or None when there is none to run it (the caller runs the build itself; unless one is
    starting, a warm process starts once the build is done)."""
    if not enabled() or argv[:1] in (["-h"], ["--help"]):
        return None
    started = time.time()
    try:
        private.ensure(private.runtime_dir())
    except private.NotPrivate as e:
        private.warn(e, "the build runs in its own process")
        return None
    ident = identity()
    path = socket_path(ident)
    if len(os.fsencode(path)) > 100:  # a Unix socket's name has at most 107 bytes
        return None
    try:
        conn = _connect(path)
    except Refused as e:
        print(f"trtforge: warning: {e}: the build runs in its own process", file=sys.stderr, flush=True)
        return None
    if conn is None:
        if not _starting(path):
            atexit.register(spawn, ident)
        return None
    with conn:
        try:
            request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "started": started})
            socket.send_fds(conn, [request.encode() + b"\n"],
                            [fd if _is_open(fd) else os.open(os.devnull, os.O_RDWR) for fd in (0, 1, 2)])
            reader = conn.makefile("r")
            first = reader.readline().split()
            child = int(first[1]) if len(first) == 2 and first[0] == "pid" else None
        except (OSError, ValueError):
            child = None
        if child is None or child <= 1:  # the warm process could not take it (stale, stopping): build here
            return None
        return _follow(reader, child)


def _follow(reader, child: int) -> int:
    """Forward signals to the build's process group until the warm process says how the build ended; end the same
    way (exit status, or death by the same signal)."""
    forwarded: list[int] = []

    def forward(sig: int, _frame) -> None:
        forwarded.append(sig)
        _killpg(child, sig)

    def suspend(_sig: int, _frame) -> None:  # Ctrl-Z: the build's group stops, then this CLI, as one job
        _killpg(child, signal.SIGSTOP)  # (its group has no parent in this session: SIGTSTP would be discarded)
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)
        signal.signal(signal.SIGTSTP, suspend)  # (continued: `fg` / `bg`)
        _killpg(child, signal.SIGCONT)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        # a signal this CLI was started ignoring stays ignored, as a build in the CLI's own process ignores it: `cmd &`
        # in a script (Ctrl-C at the terminal is not for it), `nohup` (the hangup)
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, forward)
    signal.signal(signal.SIGTSTP, suspend)
    signal.signal(signal.SIGCONT, lambda *_: _killpg(child, signal.SIGCONT))
    try:
        last = reader.readline().split()
    except OSError:
        last = []
    if len(last) == 2 and last[0] == "exit" and last[1].lstrip("-").isdigit():
        return int(last[1])
    if len(last) == 2 and last[0] == "signal" and last[1].isdigit():
        die_by(int(last[1]))
    if forwarded:  # the warm process went with the build: end as the signal this CLI got would have ended it
        die_by(forwarded[-1])
    print("trtforge: internal error: the warm build process ended without the build's exit status\n"
          "  fix: rerun without TRTFORGE_DAEMON=1 to build in this process, and report it", file=sys.stderr)
    return 1


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


def _is_open(fd: int) -> bool:
    """A CLI started with a closed stdin (cron, CI) hands /dev/null in its place."""
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _connect(path: Path) -> socket.socket | None:
    """A connection to the warm process at `path` (None: nothing listens); Refused when another user's process
    listens there."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
    except OSError:
        conn.close()
        return None
    uid = peer_uid(conn)
    if uid != os.geteuid():
        conn.close()
        raise Refused(f"{path} is served by uid {uid}, not by this user")
    return conn


def _starting(path: Path) -> bool:
    """Whether a warm process for this socket is alive (still importing, or serving), or failed to serve (its
    `.failed` mark: not started again for this identity)."""
    if os.path.lexists(path.with_suffix(".failed")):
        return True
    try:
        pid = int(private.read_private(path.with_suffix(".pid")) or 0)
        if pid > 1:
            os.kill(pid, 0)
            return True
    except OSError:
        pass
    return False


def spawn(ident: str) -> None:
    """Start a warm process for this identity, detached; nothing waits for it. At most MAX_PER_USER run: the least
    recently used others are stopped."""
    try:
        rt = private.ensure(private.runtime_dir())
    except private.NotPrivate:
        return
    path = socket_path(ident)
    _make_room(rt, keep=path)
    from flows.local import server

    env = dict(os.environ)
    if server.pointed():  # this build's own pointer at the shared server, not the user's: the warm process finds
        for k in server.POINTER_VARIABLES:  # (or starts) the server itself
            env.pop(k, None)
    # single-threaded by construction (fork safety): the child restores the BLAS threads a cold process has
    env.update(OPENBLAS_NUM_THREADS="1", JE_ARROW_MALLOC_CONF="background_thread:false")
    try:
        log = private.open_private(path.with_suffix(".log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    except OSError:
        return
    try:
        subprocess.Popen([sys.executable, "-m", "flows.local.warm", ident], stdin=subprocess.DEVNULL,
                         stdout=log, stderr=log, start_new_session=True, cwd=str(ROOT), env=env)
    finally:
        os.close(log)


def _make_room(rt: Path, keep: Path) -> None:
    """Stop the least recently used warm processes of this user until a new one keeps them at MAX_PER_USER (a warm
    process whose socket is gone exits within a second, once its builds are done)."""
    socks = []
    for s in rt.glob("*.sock"):
        try:
            socks.append((os.lstat(s).st_mtime, s))  # touched by every build it serves
        except OSError:
            pass
    socks = sorted(x for x in socks if x[1] != keep)
    for _, s in socks[:max(0, len(socks) - MAX_PER_USER + 1)]:
        s.unlink(missing_ok=True)


def served(env: dict[str, str]) -> int:
    """How many builds the warm process of this environment has served (its log; for benchmarks and tests)."""
    text = private.read_private(socket_path(identity(env)).with_suffix(".log"))
    return sum(" build " in line for line in text.splitlines())


def wait_serving(env: dict[str, str], timeout: float = 120.0) -> float | None:
    """Wait until a warm process serves this environment: the seconds waited, or None when none came."""
    sock, t0 = socket_path(identity(env)), time.monotonic()
    while not sock.exists():
        if time.monotonic() - t0 > timeout:
            return None
        time.sleep(0.1)
    return time.monotonic() - t0


def stop(env: dict[str, str]) -> None:
    """Stop the warm process of this environment (without its socket it exits within a second)."""
    socket_path(identity(env)).unlink(missing_ok=True)


def stop_all() -> int:
    """Stop every warm process of this user (tests, `make clean`): a warm process whose socket is gone exits within a
    second, once its builds are done; failure marks are cleared. Returns how many there were."""
    rt = private.runtime_dir()
    if private.problem(rt):
        return 0
    for mark in rt.glob("*.failed"):
        mark.unlink(missing_ok=True)
    socks = list(rt.glob("*.sock"))
    for sock in socks:
        sock.unlink(missing_ok=True)
    return len(socks)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "stop":
        print(f"stopped {stop_all()} warm build process(es)")
        sys.exit(0)
    print("usage: python -m flows.local.daemon stop", file=sys.stderr)
    sys.exit(2)
