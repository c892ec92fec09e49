"""The build's MLflow tracking in a child process that loads MLflow while the build runs.

MLflow's import and the opening of its tracking store take about 2 s of CPU (pandas, its GenAI modules, SQLAlchemy,
alembic's schema check), and the first run logged another 0.6 s: in the build's process they sat on its path, one
after the other under one GIL. Started when a build finds work (`start`), the child imports MLflow and opens the
store on another core while the build runs its flow; the build then sends it the two calls it makes, `log_build` and
`end_run` (flows/tracking.py), pickled over a pair of pipes only the two processes hold (no socket, no file, nothing
another user can reach), and gets the answer or the exception back. Only those two functions can be called.

The child ignores Ctrl-C (the build answers it), ends when the build closes the pipe, and dies with the build
(PR_SET_PDEATHSIG). It is not started where MLflow is imported already (a warm build process, tests) or with
TRTFORGE_TRACKER=0; when it is not running, or dies on the way, the call runs in the build's own process (both calls
are safe to repeat: log_build continues the run of the same build id). Standard library only at import."""
from __future__ import annotations

import contextlib
import os
import pickle
import struct
import subprocess
import sys
import threading

CALLS = ("log_build", "end_run")  # flows/tracking.py: what the build sends; nothing else is served


class Tracker:
    """One child process and the build's ends of its pipes."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.owner = os.getpid()  # a forked child (a sweep's worker) does not talk to its parent's tracker
        self.lock = threading.Lock()

    def start(self) -> bool:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "flows.local.tracker", str(os.getpid())],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        except OSError:
            self.proc = None
        return self.proc is not None

    def running(self) -> bool:
        return self.proc is not None and os.getpid() == self.owner and self.proc.poll() is None

    def call(self, name: str, kwargs: dict):
        """The answer of flows.tracking.`name`(**kwargs) in the child; ConnectionError when it cannot answer."""
        with self.lock:
            try:
                _send(self.proc.stdin, (name, kwargs, dict(os.environ), os.getcwd()))
                status, value = _recv(self.proc.stdout)
            except (OSError, EOFError, ValueError, pickle.PickleError, struct.error) as e:
                self.stop()
                raise ConnectionError(str(e)) from None
        if status == "ok":
            return value
        raise value

    def stop(self) -> None:
        if self.proc is None or os.getpid() != self.owner:
            self.proc = None
            return
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        self.proc = None


_tracker: Tracker | None = None  # this process's


def start() -> bool:
    """Start this process's tracker unless one runs, MLflow is imported here already, or TRTFORGE_TRACKER=0."""
    global _tracker
    if _tracker is not None and _tracker.running():
        return True
    if os.environ.get("TRTFORGE_TRACKER", "1") == "0" or "mlflow" in sys.modules:
        return False
    _tracker = Tracker()
    return _tracker.start()


def running() -> bool:
    return _tracker is not None and _tracker.running()


def call(name: str, /, **kwargs):
    """flows.tracking.`name`(**kwargs): in the tracker when it runs, else (or when it died) in this process."""
    assert name in CALLS, name
    if running():
        with contextlib.suppress(ConnectionError):
            return _tracker.call(name, kwargs)
    import flows.tracking

    return getattr(flows.tracking, name)(**kwargs)


def _send(f, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(struct.pack("!Q", len(data)) + data)
    f.flush()


def _recv(f):
    head = f.read(8)
    if len(head) < 8:
        raise EOFError("the tracker closed its pipe")
    (n,) = struct.unpack("!Q", head)
    data = f.read(n)
    if len(data) < n:
        raise EOFError("the tracker closed its pipe")
    return pickle.loads(data)


# --- the child's side ----------------------------------------------------------------------------------------------

def _answer(value) -> tuple[str, object]:
    """("ok", value) or ("error", the exception when it pickles, else a RuntimeError with its type and text)."""
    if not isinstance(value, BaseException):
        return "ok", value
    try:
        pickle.loads(pickle.dumps(value))
        return "error", value
    except Exception:  # noqa: BLE001
        return "error", RuntimeError(f"{type(value).__name__}: {value}")


def serve(parent: int) -> int:
    import ctypes
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the build's to answer; this ends with it
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the build ended before the line above
        return 0
    import gc

    gc.disable()  # a short-lived process: the collector's passes over what MLflow's import creates cost a third of it
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # what MLflow prints must not reach the pipe
    from flows.env import env_defaults

    env_defaults()
    import flows.tracking

    flows.tracking.warm_store()
    while True:
        try:
            name, kwargs, env, cwd = _recv(stdin)
        except (EOFError, OSError):
            return 0  # the build is done
        try:
            if name not in CALLS:
                raise ValueError(f"the tracker serves {CALLS}, not {name!r}")
            if env != os.environ:
                os.environ.clear()
                os.environ.update(env)
            os.chdir(cwd)
            value = getattr(flows.tracking, name)(**kwargs)
        except BaseException as e:  # noqa: BLE001 - the build decides what it means
            value = e
        try:
            _send(stdout, _answer(value))
        except (OSError, pickle.PickleError):
            return 0


if __name__ == "__main__":
    _code = serve(int(sys.argv[1]))
    for _f in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            _f.flush()
    os._exit(_code)  # no interpreter teardown: nothing waits for it
