"""A warm build process: `python -m flows.build` hands its build to it instead of importing Prefect, MLflow, ONNX,
ONNX Runtime and TensorRT again (seconds of imports per call, the fixed cost that dwarfed small builds).

Like Gradle's daemon or a zygote: the first CLI build of a session runs in its own process and, once done, starts
`python -m flows.local.daemon serve` detached; the daemon imports everything once, with Prefect pointed at the machine's
shared local server (flows/local/server.py), and waits on a Unix socket. A later CLI call sends its arguments, working
directory, environment, start time and its stdin/stdout/stderr file descriptors; the daemon forks, and the child
runs exactly what the CLI would have run, writing straight to the caller's terminal, then reports the exit status.
The CLI forwards Ctrl-C and termination signals to the child; when the CLI dies (even by SIGKILL) the child and
everything it started are killed, as if they had been the CLI.

A daemon serves one interpreter, one version of trtforge's code, one set of installed packages and one environment
(all part of its socket's name): a changed file, a pip install or another PREFECT_*/MLFLOW_* setting gets a new
daemon, and the old one exits when idle (TRTFORGE_DAEMON_IDLE seconds, default 600). TRTFORGE_DAEMON=0 turns it off.
Standard library only, so that the CLI's side costs a few milliseconds.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IDLE_SECONDS = float(os.environ.get("TRTFORGE_DAEMON_IDLE", "600"))
# what does not change a build: the caller's shell, terminal and working directory (sent with every request)
VOLATILE = ("PWD", "OLDPWD", "SHLVL", "_", "COLUMNS", "LINES", "TERM", "COLORTERM", "TERM_PROGRAM",
            "TERM_PROGRAM_VERSION", "TMUX", "TMUX_PANE", "STY", "WINDOW", "DISPLAY", "WINDOWID", "SSH_CLIENT",
            "SSH_CONNECTION", "SSH_TTY", "SSH_AUTH_SOCK", "MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKE_TERMOUT",
            "MAKE_TERMERR", "PS1", "PROMPT_COMMAND", "TRTFORGE_DAEMON_IDLE", "TRTFORGE_TIMELINE")


WARM = False  # True in a build forked from a warm process (a sweep then forks its workers too)


def enabled() -> bool:
    return os.environ.get("TRTFORGE_DAEMON", "1") not in ("0", "false", "no", "off")


def identity(env: dict[str, str] | None = None) -> str:
    """What a warm process depends on: interpreter, trtforge's code (size and mtime of every module), the installed
    packages (site-packages' mtime changes with every install) and the environment."""
    env = dict(os.environ if env is None else env)
    h = hashlib.sha256(sys.executable.encode())
    for d in ("flows", "tasks"):
        for f in sorted((ROOT / d).rglob("*.py")):
            st = f.stat()
            h.update(f"{f.relative_to(ROOT)}:{st.st_size}:{st.st_mtime_ns}".encode())
    for p in sys.path:
        if p.endswith("site-packages") and os.path.isdir(p):
            h.update(f"{p}:{os.stat(p).st_mtime_ns}".encode())
    h.update(json.dumps({k: v for k, v in sorted(env.items()) if k not in VOLATILE}).encode())
    return h.hexdigest()[:20]


def socket_path(ident: str) -> Path:
    return Path(tempfile.gettempdir()) / f"trtforge-daemon-{os.getuid()}" / f"{ident}.sock"


# --- the CLI's side --------------------------------------------------------------------------------------------

def delegate(entry: str, argv: list[str]) -> int | None:
    """Run the CLI `entry` ("module:function", called with argv and the start time, returning the exit status) in a
    warm process: its exit status, or None when there is none to run it (the caller runs it in-process; a warm
    process is started for the next call)."""
    if not enabled() or argv[:1] in (["-h"], ["--help"]):
        return None
    started = time.time()
    ident = identity()
    path = socket_path(ident)
    conn = _connect(path)
    if conn is None:  # build here; unless one is on its way, a warm process starts once this build is done
        if not _starting(path):
            atexit.register(spawn, ident)
        return None
    with conn:
        try:
            request = json.dumps({"entry": entry, "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ),
                                  "started": started}).encode()
            socket.send_fds(conn, [request], [fd if _is_open(fd) else os.open(os.devnull, os.O_RDWR) for fd in (0, 1, 2)])
            reader = conn.makefile("r")
            first = reader.readline().split()
            child = int(first[1]) if len(first) == 2 and first[0] == "pid" else None
        except (OSError, ValueError):
            child = None
        if child is None:  # the daemon could not take it (stale, stopping): build here
            return None
        forwarded: list[int] = []  # from here on the build is the child's: never built twice

        def forward(sig: int, _frame) -> None:
            forwarded.append(sig)
            _kill(child, sig)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, forward)
        try:
            last = reader.readline().split()
        except OSError:
            last = []
        if len(last) == 2 and last[0] == "exit":
            return int(last[1])
        if forwarded:  # the build ended by the signal this CLI got: end as it would have
            return 128 + forwarded[-1]
        print("trtforge: internal error: the build process died without an exit status\n"
              "  fix: rerun with TRTFORGE_DAEMON=0 to build in this process, and report it", file=sys.stderr)
        return 1


def _is_open(fd: int) -> bool:
    """A CLI started with a closed stdin (cron, CI) hands /dev/null in its place."""
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _connect(path: Path) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
        return conn
    except OSError:
        conn.close()
        return None


def _starting(path: Path) -> bool:
    """Whether a warm process for this socket is alive (still importing, or serving)."""
    try:
        pid = int(path.with_suffix(".pid").read_text())
        os.kill(pid, 0)
        return True
    except (OSError, ValueError):
        return False


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def spawn(ident: str) -> None:
    """Start a warm process for this identity, detached; nothing waits for it."""
    path = socket_path(ident)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    from flows.local import server

    env = dict(os.environ)
    if server.pointed():  # this build's own pointer at the shared server, not the user's: the warm process finds
        env.pop("PREFECT_API_URL", None)  # (or starts) the server itself and holds a lease on it while it lives
    log = open(path.with_suffix(".log"), "ab")
    subprocess.Popen([sys.executable, "-m", "flows.local.daemon", "serve", ident], stdin=subprocess.DEVNULL, stdout=log,
                     stderr=subprocess.STDOUT, start_new_session=True, cwd=str(ROOT), env=env)
    log.close()


# --- the warm process ------------------------------------------------------------------------------------------

# what builds import lazily, by stage (measured with sys.modules after builds); torch stays out (a torch export pays
# its import: half a gigabyte held by every warm process otherwise)
WARM_MODULES = (
    "hydra", "hydra.compose", "hydra.initialize", "hydra.core.global_hydra", "hydra._internal.config_loader_impl",
    "hydra._internal.utils", "omegaconf",
    "prefect", "prefect.flows", "prefect.tasks", "prefect.engine", "prefect.flow_engine", "prefect.task_engine",
    "prefect.runtime", "prefect.runtime.flow_run", "prefect.client.orchestration", "prefect.concurrency.sync",
    "prefect.cache_policies", "prefect.results", "anyio", "httpx",
    "mlflow", "mlflow.tracking", "mlflow.entities", "mlflow.artifacts", "mlflow.store.tracking.sqlalchemy_store",
    "mlflow.store.model_registry.sqlalchemy_store", "mlflow.store.db.utils", "sqlalchemy", "alembic",
    "onnx", "onnx.shape_inference", "onnx.helper", "onnx.numpy_helper", "onnxruntime", "onnxruntime.quantization",
    "onnxconverter_common", "onnxconverter_common.float16", "tensorrt_rtx_bindings", "numpy", "PIL.Image",
    "matplotlib.pyplot", "graphviz", "rich.console", "rich.progress", "rich._emoji_codes", "yaml",
)


def warm_up() -> str | None:
    """Import what a build uses, with Prefect pointed at the shared local server first (Prefect reads its API URL
    when imported). Returns the server's URL (None: the user's PREFECT_API_URL or Prefect's own)."""
    from flows.env import env_defaults

    env_defaults()
    from flows.local import server

    url = server.ensure()  # also this process's lease: the server stays up while builds can come
    import importlib

    import matplotlib

    matplotlib.use("Agg")
    for d in ("flows", "tasks"):  # every stage and flow module (a build imports them lazily)
        for f in sorted((ROOT / d).rglob("*.py")):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            if f.stem != "__init__" and name != __name__ and name != "flows.local.daemon":
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
    path = socket_path(ident)
    pidfile = path.with_suffix(".pid")
    pidfile.write_text(str(os.getpid()))
    code = 1
    try:
        code = _serve(path, warm_up())
        return code
    finally:
        if _read(pidfile) == str(os.getpid()):
            pidfile.unlink(missing_ok=True)
            if code == 0:  # an idle or stopped daemon leaves nothing behind (a failed one keeps its log)
                path.with_suffix(".log").unlink(missing_ok=True)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _serve(path: Path, url: str | None) -> int:
    import threading

    if threading.active_count() != 1:  # forking a process with other threads is unsafe: do not serve
        print(f"trtforge daemon: {threading.active_count()} threads after the imports; not serving", file=sys.stderr)
        return 1
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    listener.bind(str(tmp))
    os.replace(tmp, path)  # the newest daemon of an identity takes over its name
    mine = os.stat(path).st_ino
    listener.listen(16)
    listener.settimeout(1.0)
    children: set[int] = set()
    last = time.monotonic()
    try:
        while True:
            _reap(children)
            if children:
                last = time.monotonic()
            elif time.monotonic() - last > IDLE_SECONDS or not _still_mine(path, mine):
                return 0
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            last = time.monotonic()
            with conn:
                try:
                    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                    request = json.loads(msg.decode())
                except (OSError, ValueError):
                    continue
                if len(fds) != 3 or (url and not _healthy(url)):  # the shared server is gone: let the CLI build
                    for fd in fds:
                        os.close(fd)
                    if url and not _healthy(url):
                        return 0
                    continue
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    _child(conn, fds, request)  # never returns
                for fd in fds:
                    os.close(fd)
                children.add(pid)
                conn.sendall(f"pid {pid}\n".encode())
                print(f"{time.strftime('%H:%M:%S')} build {pid}: {' '.join(request['argv'])} (in {request['cwd']})",
                      flush=True)  # the daemon's log
    finally:
        if _still_mine(path, mine):
            path.unlink(missing_ok=True)


def _still_mine(path: Path, inode: int) -> bool:
    """Whether the socket's name is still this process's (a newer daemon of the identity, or stop_all, takes it)."""
    try:
        return os.stat(path).st_ino == inode
    except OSError:
        return False


def _healthy(url: str) -> bool:
    from flows.local import server

    return server.healthy(url, timeout=2.0)


def _reap(children: set[int]) -> None:
    for pid in list(children):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            children.discard(pid)


def _child(conn: socket.socket, fds: list[int], request: dict) -> None:
    """The build, as the CLI would have run it, in the caller's directory, environment and terminal."""
    import io
    import threading

    code = 1
    try:
        os.setpgid(0, 0)  # its own group: killed whole with the CLI
        for fd, std in zip(fds, (0, 1, 2)):
            os.dup2(fd, std)
            os.close(fd)
        sys.stdin = io.TextIOWrapper(os.fdopen(0, "rb", closefd=False), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), encoding="utf-8", line_buffering=True)
        sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), encoding="utf-8", line_buffering=True)
        os.chdir(request["cwd"])
        url = os.environ.get("PREFECT_API_URL")  # the shared server this process's Prefect was pointed at
        os.environ.clear()
        os.environ.update(request["env"])
        from flows.env import env_defaults

        env_defaults()
        if url:
            os.environ.setdefault("PREFECT_API_URL", url)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        sys.argv = [sys.argv[0], *request["argv"]]
        threading.Thread(target=_watch, args=(conn,), daemon=True).start()
        global WARM
        WARM = True
        import importlib

        module, _, function = request["entry"].partition(":")
        code = getattr(importlib.import_module(module), function)(request["argv"], started=request.get("started"))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    except BaseException as e:  # noqa: BLE001 - reported like the CLI reports an internal error
        print(f"trtforge: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            conn.sendall(f"exit {code}\n".encode())
        except BaseException:  # noqa: BLE001
            pass
        os._exit(code)


def _watch(conn: socket.socket) -> None:
    """The CLI closed the connection before the build ended: it is gone, so is the build (and what it started)."""
    try:
        while conn.recv(1024):
            pass
    except OSError:
        pass
    os.killpg(os.getpgrp(), signal.SIGKILL)


def served(env: dict[str, str]) -> int:
    """How many builds the warm process of this environment has served (its log; for benchmarks and tests)."""
    log = socket_path(identity(env)).with_suffix(".log")
    try:
        return sum(" build " in line for line in log.read_text().splitlines())
    except OSError:
        return 0


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
    """Stop every warm process of this user (tests, `make clean`): a daemon whose socket is gone exits within a
    second, once its builds are done. Returns how many there were."""
    socks = list(socket_path("x").parent.glob("*.sock"))
    for sock in socks:
        sock.unlink(missing_ok=True)
    return len(socks)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        sys.exit(serve(sys.argv[2]))
    if len(sys.argv) == 2 and sys.argv[1] == "stop":
        print(f"stopped {stop_all()} warm build process(es)")
        sys.exit(0)
    print("usage: python -m flows.local.daemon serve IDENTITY | stop", file=sys.stderr)
    sys.exit(2)
