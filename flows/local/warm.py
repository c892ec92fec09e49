"""The warm build process itself (flows/local/daemon.py has the CLI's side and the whole design): it imports what a
build uses once, listens on the identity's socket in the user's private runtime folder, and forks a child per request
that runs the build CLI exactly as a cold process would, in the caller's directory, environment and terminal.
Started as `python -m flows.local.warm IDENTITY`."""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import signal
import socket
import sys
import time
from pathlib import Path

from flows.local import private
from flows.local.daemon import (ENTRY, IDLE_SECONDS, REQUEST_SECONDS, ROOT, _killpg, peer_uid, socket_path,
                                threads)

# what builds import lazily, by stage (measured with sys.modules after builds); torch stays out (a torch export pays
# its import: half a gigabyte held by every warm process otherwise), and so does ONNX Runtime (its import starts a
# native thread, and a process with threads must not fork; the child imports it in about 0.1 s)
WARM_MODULES = (
    "hydra", "hydra.compose", "hydra.initialize", "hydra.core.global_hydra", "hydra._internal.config_loader_impl",
    "hydra._internal.utils", "omegaconf",
    "prefect", "prefect.flows", "prefect.tasks", "prefect.engine", "prefect.flow_engine", "prefect.task_engine",
    "prefect.runtime", "prefect.runtime.flow_run", "prefect.client.orchestration", "prefect.concurrency.sync",
    "prefect.cache_policies", "prefect.results", "anyio", "httpx",
    "mlflow", "mlflow.tracking", "mlflow.entities", "mlflow.artifacts", "mlflow.store.tracking.sqlalchemy_store",
    "mlflow.store.model_registry.sqlalchemy_store", "mlflow.store.db.utils", "sqlalchemy", "alembic",
    "onnx", "onnx.shape_inference", "onnx.helper", "onnx.numpy_helper",
    "onnxconverter_common", "onnxconverter_common.float16", "tensorrt_rtx_bindings", "numpy", "PIL.Image",
    "matplotlib.pyplot", "graphviz", "rich.console", "rich.progress", "rich._emoji_codes", "yaml",
)


def warm_up() -> str | None:
    """Import what a build uses, with Prefect pointed at the shared local server first (Prefect reads its API URL
    when imported). Returns the server's URL (None: the user's PREFECT_API_URL or Prefect's own)."""
    from flows.env import env_defaults

    env_defaults()
    from flows.local import server

    url = server.ensure()  # (its lease is dropped once warm: an idle warm process keeps no server running)
    import importlib

    import matplotlib

    matplotlib.use("Agg")
    for d in ("flows", "tasks"):  # every stage and flow module (a build imports them lazily)
        for f in sorted((ROOT / d).rglob("*.py")):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            if f.stem != "__init__" and name not in (__name__, "flows.local.warm"):
                importlib.import_module(name)
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional one (paddle, a backend) is simply not warm
            pass
    from flows.lazy import Deferred

    for name, module in list(sys.modules.items()):  # Prefect's decorators applied to the flows and tasks
        if name.startswith("flows."):
            for obj in list(vars(module).values()):
                if isinstance(obj, Deferred):
                    obj.prefect()
    _complete_models()
    _draw_once()
    try:
        import threadpoolctl  # noqa: F401  (the child sets BLAS threads with it)
    except ImportError:
        pass
    server.release_lease()
    return url


def _draw_once() -> None:
    """One small figure with text, saved to memory: matplotlib loads its fonts on the first draw (report plots)."""
    import io

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 1))
    ax.plot([0, 1], [0, 1], label="warm")
    ax.legend()
    fig.tight_layout()
    fig.savefig(io.BytesIO(), format="png", dpi=50)
    plt.close(fig)


def _complete_models() -> None:
    """Pydantic models that build their validators on first use (Prefect's client schemas: ~0.3 s in every build)."""
    import pydantic

    todo, seen = [pydantic.BaseModel], set()
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
    for model in seen:
        if not getattr(model, "__pydantic_complete__", True):
            try:
                model.model_rebuild()
            except Exception:  # noqa: BLE001 - it completes on first use, as without a warm process
                pass


def serve(ident: str) -> int:
    """Listen on the identity's socket; fork a child per request; exit after IDLE_SECONDS without a build."""
    try:
        rt = private.ensure(private.runtime_dir())
    except private.NotPrivate as e:
        print(f"trtforge daemon: {e}; not serving", flush=True)
        return 1
    path = socket_path(ident)
    pidfile = path.with_suffix(".pid")
    private.write_private(pidfile, str(os.getpid()))
    code = 1
    try:
        code = _serve(rt, path, warm_up())
        return code
    finally:
        if private.read_private(pidfile) == str(os.getpid()):
            pidfile.unlink(missing_ok=True)
            if code == 0:  # an idle or stopped warm process leaves nothing behind (a failed one keeps its log)
                path.with_suffix(".log").unlink(missing_ok=True)
            else:  # and is not started again for this identity (`python -m flows.local.daemon stop` clears it)
                private.write_private(path.with_suffix(".failed"), str(code))


def _serve(rt: Path, path: Path, url: str | None) -> int:
    n = threads()
    if n != 1:  # forking a process with other threads is unsafe: do not serve
        print(f"trtforge daemon: {n} threads after the imports (/proc/self/task); not serving", flush=True)
        return 1
    return _Loop(rt, path, url).run()


class _Loop:
    """The warm process's event loop: connections from the user's CLIs, their requests, the builds forked for them
    and how each ends, on one selector; the state every handler shares lives here."""

    def __init__(self, rt: Path, path: Path, url: str | None):
        self.rt, self.path, self.url = rt, path, url
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        self.listener.bind(str(tmp))
        os.replace(tmp, path)  # the newest warm process of an identity takes over its name
        self.mine = os.lstat(path).st_ino
        self.listener.listen(16)
        self.listener.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, ("listen", None))
        self.pending: dict[socket.socket, float] = {}  # accepted, request not read yet: until when it may come
        self.builds: dict[int, tuple[socket.socket, int]] = {}  # pid -> (the CLI's connection, a pidfd)
        self.last = time.monotonic()

    def run(self) -> int:
        try:
            while True:
                if not self.builds and not self.pending and (time.monotonic() - self.last > IDLE_SECONDS
                                                             or not _still_mine(self.path, self.mine)
                                                             or private.problem(self.rt)):
                    return 0
                for key, _ in self.sel.select(timeout=1.0):
                    kind, data = key.data
                    if kind == "listen":
                        self._accept()
                    elif kind == "request" and self._request(key.fileobj) == "stop":
                        return 0
                    elif kind == "client":
                        self._client_gone(key.fileobj, data)
                    elif kind == "exit":
                        self._build_ended(data)
                self._drop_silent()
        finally:
            if _still_mine(self.path, self.mine):
                self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        uid = peer_uid(conn)
        if uid != os.geteuid():
            print(f"{time.strftime('%H:%M:%S')} refused a connection from uid {uid}", flush=True)
            conn.close()
            return
        self.pending[conn] = time.monotonic() + REQUEST_SECONDS
        self.sel.register(conn, selectors.EVENT_READ, ("request", None))

    def _request(self, conn: socket.socket) -> str | None:
        """Read a request and fork its build; "stop" when the shared server is gone (the CLI then builds itself)."""
        self.sel.unregister(conn)
        self.pending.pop(conn, None)
        got = _receive(conn)
        if got is None:
            conn.close()
            return None
        request, fds = got
        if (self.url and not _healthy(self.url)) or threads() != 1:  # the shared server is gone (or a thread
            for fd in fds:                                             # appeared): let the CLI build itself
                os.close(fd)
            conn.close()
            return "stop" if self.url and not _healthy(self.url) else None
        others = [self.listener, *self.pending, *(c for c, _ in self.builds.values()),
                  *(p for _, p in self.builds.values())]
        pid = os.fork()
        if pid == 0:
            self.sel.close()
            _child(conn, fds, request, others)  # never returns
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)  # (the child does too: whichever runs first, the CLI may signal it)
        _lease(pid)
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.builds[pid] = (conn, pidfd)
        self.sel.register(pidfd, selectors.EVENT_READ, ("exit", pid))
        self.sel.register(conn, selectors.EVENT_READ, ("client", pid))
        with contextlib.suppress(OSError):
            conn.sendall(f"pid {pid}\n".encode())
            os.utime(self.path, follow_symlinks=False)  # recently used (the per-user cap stops the oldest)
        print(f"{time.strftime('%H:%M:%S')} build {pid}: {' '.join(request['argv'])} (in {request['cwd']})",
              flush=True)  # the warm process's log
        return None

    def _client_gone(self, conn: socket.socket, pid: int) -> None:
        """The CLI closed its end before the build ended: it is gone, so is the build."""
        if pid not in self.builds:
            return
        with contextlib.suppress(OSError):
            if conn.recv(1024, socket.MSG_DONTWAIT):
                return
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn)
        _killpg(pid, signal.SIGKILL)

    def _build_ended(self, pid: int) -> None:
        """Tell the CLI how its build ended ("exit N" or "signal N"), so that it ends the same way."""
        conn, pidfd = self.builds.pop(pid)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn)
        _, status = os.waitpid(pid, 0)
        line = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.waitstatus_to_exitcode(status)}"
        with contextlib.suppress(OSError):
            conn.sendall(f"{line}\n".encode())
        conn.close()
        self.last = time.monotonic()

    def _drop_silent(self) -> None:
        """A client that connected and said nothing within REQUEST_SECONDS is dropped, not waited for."""
        now = time.monotonic()
        for conn, deadline in list(self.pending.items()):
            if now > deadline:
                self.pending.pop(conn)
                self.sel.unregister(conn)
                conn.close()


def _receive(conn: socket.socket) -> tuple[dict, list[int]] | None:
    """The request (one JSON line) and the caller's three descriptors; None when it is not one."""
    fds: list[int] = []
    try:
        conn.settimeout(REQUEST_SECONDS)
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        deadline = time.monotonic() + REQUEST_SECONDS
        while msg and not msg.endswith(b"\n") and time.monotonic() < deadline:
            more = conn.recv(1 << 20)
            if not more:
                break
            msg += more
        request = json.loads(msg.decode())
        ok = (isinstance(request, dict) and isinstance(request.get("argv"), list)
              and all(isinstance(a, str) for a in request["argv"]) and isinstance(request.get("cwd"), str)
              and isinstance(request.get("env"), dict)
              and all(isinstance(k, str) and isinstance(v, str) for k, v in request["env"].items()))
        if ok and len(fds) == 3:
            conn.settimeout(None)
            return request, fds
    except (OSError, ValueError):
        pass
    for fd in fds:
        os.close(fd)
    return None


def _lease(pid: int) -> None:
    """The build's lease on the shared Prefect server, from its first instant (its own lease() takes it over)."""
    from flows.local import server

    with contextlib.suppress(OSError, private.NotPrivate):
        server.take_lease(pid)


def _still_mine(path: Path, inode: int) -> bool:
    """Whether the socket's name is still this process's (a newer warm process of the identity, or stop, takes it)."""
    try:
        return os.lstat(path).st_ino == inode
    except OSError:
        return False


def _healthy(url: str) -> bool:
    from flows.local import server

    return server.healthy(url, timeout=2.0)


def _child(conn: socket.socket, fds: list[int], request: dict, others: list) -> None:
    """The build, as the CLI would have run it, in the caller's directory, environment and terminal."""
    import io

    try:
        os.setpgid(0, 0)  # its own group: the CLI's signals reach it and everything it starts
        atexit._clear()  # the warm process's exit handlers are not the build's
        for o in others:
            with contextlib.suppress(OSError):
                o.close() if hasattr(o, "close") else os.close(o)
        conn.close()  # the warm process reports how this build ends
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGTSTP, signal.SIGCONT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        for fd, std in zip(fds, (0, 1, 2)):
            os.dup2(fd, std)
            os.close(fd)
        sys.stdin = io.TextIOWrapper(os.fdopen(0, "rb", closefd=False), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), encoding="utf-8", line_buffering=True)
        sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), encoding="utf-8", line_buffering=True)
        os.chdir(request["cwd"])
        from flows.local import server

        pointer = {k: os.environ[k] for k in server.POINTER_VARIABLES if k in os.environ}  # the shared server
        os.environ.clear()
        os.environ.update(request["env"])
        from flows.env import env_defaults

        env_defaults()
        if "PREFECT_API_URL" not in os.environ:
            os.environ.update(pointer)
        _blas_threads()
        sys.argv = [sys.argv[0], *request["argv"]]
        import importlib

        importlib.import_module(ENTRY).cli(request["argv"], started=request.get("started"))  # never returns
    except BaseException as e:  # noqa: BLE001 - reported as the CLI reports an internal error
        with contextlib.suppress(OSError):
            print(f"trtforge: internal error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    os._exit(1)


def _blas_threads() -> None:
    """The OpenBLAS threads a cold process would start with (the warm process imported numpy with one)."""
    n = 0
    for k in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"):
        v = os.environ.get(k, "").strip()
        if v.isdigit() and int(v) > 0:
            n = int(v)
            break
    n = n or len(os.sched_getaffinity(0))
    if n > 1:
        try:
            from threadpoolctl import threadpool_limits

            threadpool_limits(n, user_api="blas")
        except Exception:  # noqa: BLE001 - one BLAS thread: slower, same results
            pass


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m flows.local.warm IDENTITY (started by the build CLI: flows/local/daemon.py)",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(serve(sys.argv[1]))
