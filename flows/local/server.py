"""One local Prefect server shared by a user's builds, instead of a temporary server per build process.

Without PREFECT_API_URL, Prefect 3 starts a temporary API server in a subprocess for every process that runs a flow:
about 4-7 s each time (13 s on a new database), which dominated every small build, sweep entry and scheduled rebuild.
Here the first build starts `prefect server start` on a free port of 127.0.0.1, detached, under a watchdog
(`python -m flows.local.server serve`), records it in `$PREFECT_HOME/trtforge-server.json`, and every later build finds it
there and only checks it (milliseconds). The port is bound by the build that chooses it and handed down to the server
(no window in which another user could take it), and the API requires the user's secret (Prefect's own API
authentication: PREFECT_SERVER_API_AUTH_STRING on the server, PREFECT_API_AUTH_STRING in the builds), kept in a 0600
file in the user's private folder (flows/local/private.py); a recorded server is used only when the kernel says its
listening socket is the user's and it refuses requests without the secret and accepts them with it. The record says
only which port and watchdog: the API's address is always http://127.0.0.1:PORT/api, made here from the port, so no
record decides where the secret goes. PREFECT_HOME is a folder of the user's own (0700, checked before use;
private.require), else the build is refused with exit 2, and every file trtforge writes there (record, log, leases) is
opened without following a link. The start is begun early (begin(): the CLI's first step, before its
imports, config and preflight) and waited for only when the flow begins (ensure()); a new Prefect home starts from a
migrated template database (flows/local/templates.py). Each build holds a lease (a file named after its pid) while it runs;
the watchdog stops the server once no live build has held a lease for TRTFORGE_SERVER_IDLE seconds (default 600). A
killed build's lease dies with its pid, so nothing outlives builds for long.

A user's PREFECT_API_URL always wins (e.g. `make serve`'s server, or a team's; with the user's own
PREFECT_API_AUTH_STRING). TRTFORGE_PREFECT=ephemeral keeps Prefect's own per-process temporary server (so does a
private folder that is not private, with a warning).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from flows.local import private
from flows.local.locks import named_lock, pid_alive
from flows.local.net import auth_header, authenticated, healthy, listener_uid, reserve  # noqa: F401  (healthy: also for callers)
from flows.local.prefect_api import server_command

IDLE_SECONDS = float(os.environ.get("TRTFORGE_SERVER_IDLE", "600"))
STARTUP_SECONDS = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90"))


# what begin() sets in a build's environment to point it at the shared server (not the user's own settings)
POINTER_VARIABLES = ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING")
SECRET_NAME = "prefect-api-auth"


def auth_string() -> str:
    """This user's secret for the local Prefect APIs trtforge starts (NotPrivate when its folder or file is not
    private)."""
    return private.secret(SECRET_NAME)


def api_url(port: int) -> str:
    """The address of the local API on `port`: made from the port alone, never read from a record."""
    return f"http://127.0.0.1:{int(port)}/api"


def ours(st: dict, secret: str) -> bool:
    """Whether the server of this record is this user's: its listening socket belongs to this user (asked before the
    secret is sent) and it requires, and accepts, the secret, at the address made from its port."""
    port = int(st.get("port", 0))
    return 0 < port < 65536 and listener_uid(port) == os.geteuid() and authenticated(api_url(port), secret)


def home() -> Path:
    return Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()


def private_home() -> Path:
    """PREFECT_HOME as a private folder of this user (made 0700 when missing); NotPrivate (exit 2, naming it and the
    fix) when another user could write or read it: their records and links would steer the build."""
    return private.require(home(), "PREFECT_HOME")


def state_file() -> Path:
    return home() / "trtforge-server.json"


def lease_dir() -> Path:
    return home() / "trtforge-leases"


def read_record(path: Path | None = None) -> dict | None:
    """The record of the shared server (pid of its watchdog and port), read without following a link, its address made
    from the port (api_url); None when there is none or it does not parse."""
    try:
        st = json.loads(private.read_private(path or state_file()))
        pid, port = int(st["pid"]), int(st["port"])
    except (ValueError, KeyError, TypeError):
        return None
    if pid <= 1 or not 0 < port < 65536:
        return None
    return {"pid": pid, "port": port, "url": api_url(port), "started": st.get("started")}


def running(secret: str | None = None) -> dict | None:
    """The shared server's record when it answers and is this user's (ours()), else None."""
    st = read_record()
    if st is None or not (pid_alive(st["pid"]) and healthy(st["url"])):
        return None
    try:
        return st if ours(st, secret or auth_string()) else None
    except private.NotPrivate:
        return None


@contextlib.contextmanager
def lease() -> Iterator[None]:
    """This process uses the shared server while the block runs (the watchdog sees the pid alive)."""
    f = take_lease(os.getpid())
    try:
        yield
    finally:
        f.unlink(missing_ok=True)


def take_lease(pid: int) -> Path:
    """The lease file of `pid` in the private lease folder, made without following a link."""
    d = private.ensure(lease_dir())
    f = d / str(pid)
    os.close(private.open_private(f, os.O_WRONLY | os.O_CREAT))
    return f


_mine: dict | None = None  # the shared server this process pointed Prefect at (begin), healthy or starting
_spawned_by: int | None = None  # the pid of the process that started it, when this one did (a fork inherits this)
_used = False  # whether a flow of this process has used it (ensure)


def _record() -> dict | None:
    """The shared server's record when its watchdog lives (answering already, or still starting)."""
    st = read_record()
    return st if st is not None and pid_alive(st["pid"]) else None


def begin() -> bool:
    """Point this process's Prefect at the shared local server, starting it in the background when none runs
    (without waiting: a build's imports, config and preflight overlap its start; ensure() waits for it). True when
    PREFECT_API_URL is set from here on (Prefect may be imported), False when Prefect does as it does by itself
    (TRTFORGE_PREFECT=ephemeral, or Prefect configured in this process already, e.g. by a test harness)."""
    global _mine, _spawned_by
    if _mine is not None or os.environ.get("PREFECT_API_URL"):
        return True
    private_home()  # Prefect keeps its database there (its own temporary server too), trtforge its record: the user's
    if os.environ.get("TRTFORGE_PREFECT") == "ephemeral":  # own, or refused
        return False
    if "prefect" in sys.modules:  # Prefect already configured in this process (a test harness, a served flow)
        from prefect.settings import get_current_settings

        if get_current_settings().api.url:
            return False
    try:
        secret = auth_string()
    except private.NotPrivate as e:
        private.warn(e, "the build uses Prefect's own temporary server")
        os.environ["TRTFORGE_PREFECT"] = "ephemeral"  # (its sweep workers too)
        return False
    take_lease(os.getpid())  # this build uses the server from now on (lease() releases it)
    st = running(secret)
    if st is None:
        with named_lock(home(), "prefect-server"):  # two builds starting at once: one server
            st = _record()
            if st is not None and healthy(st["url"], timeout=1.0) and not ours(st, secret):
                st = None  # answering, but not this user's server (or not with this secret): a new one
            if st is None:
                st, _spawned_by = spawn(secret), os.getpid()
    os.environ["PREFECT_API_URL"] = st["url"]
    os.environ["PREFECT_API_AUTH_STRING"] = secret
    _mine = st
    return True


def ensure() -> str | None:
    """Point this process's Prefect at the shared local server, starting it when none answers, and wait until it
    answers; the API URL, or None when Prefect should do as it does by itself (PREFECT_API_URL set by the user, or
    TRTFORGE_PREFECT=ephemeral)."""
    if _mine is None and (os.environ.get("PREFECT_API_URL") or not begin()):
        return None
    assert _mine is not None
    wait(_mine)
    global _used
    _used = True
    return _mine["url"]


def release_lease() -> None:
    """This process no longer uses the shared server (a warm build process going idle: its builds take their own)."""
    (lease_dir() / str(os.getpid())).unlink(missing_ok=True)


def release_unused() -> None:
    """Stop the server this process started early (begin) when no flow used it after all (the build was up to date,
    or its input bad) and no other build holds a lease: nothing keeps running for a command that needed no server."""
    if _mine is None or _used or _spawned_by != os.getpid():
        return
    (lease_dir() / str(os.getpid())).unlink(missing_ok=True)
    if not busy():
        import signal

        with contextlib.suppress(OSError):
            os.kill(int(_mine["pid"]), signal.SIGTERM)  # (its server follows it: PR_SET_PDEATHSIG)
        st = read_record()  # a watchdog stopped before its handler was set leaves the record
        if st is not None and st["pid"] == _mine["pid"]:
            state_file().unlink(missing_ok=True)


def wait(st: dict) -> None:
    """Until the server of this record answers; UnavailableError when its watchdog dies or it takes too long."""
    from tasks.common import UnavailableError

    t0, fresh = time.monotonic(), False
    while not healthy(st["url"], timeout=1.0):
        fresh = True
        if not pid_alive(int(st["pid"])) or time.monotonic() - t0 > STARTUP_SECONDS:
            with contextlib.suppress(OSError):
                os.kill(int(st["pid"]), 9)
            raise UnavailableError(f"the local Prefect server on {st['url']} did not start "
                                   f"(see {home() / 'trtforge-server.log'})",
                                   fix="set PREFECT_API_URL to a running server, or TRTFORGE_PREFECT=ephemeral")
        time.sleep(0.1)
    if fresh:
        _first_write(st["url"], os.environ.get("PREFECT_API_AUTH_STRING"))


def _first_write(url: str, secret: str | None, seconds: float = 5.0) -> None:
    """The first write to a server that has just started: the flow every build creates first (`trtforge-build`),
    retried every 0.1 s while the server answers 503. Its start-up services hold SQLite's write lock for a moment
    after it answers /health; Prefect's client, meeting that with the first flow run, backs off for 2 s."""
    import urllib.error

    body = json.dumps({"name": "trtforge-build"}).encode()
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        req = urllib.request.Request(f"{url.rstrip('/')}/flows/", data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              **(auth_header(secret) if secret else {})})
        try:
            with urllib.request.urlopen(req, timeout=2.0):
                return
        except urllib.error.HTTPError as e:
            if e.code != 503:
                return  # not the lock: the build's own calls report anything real
        except OSError:
            return
        time.sleep(0.1)


def seed_home() -> dict[str, str]:
    """A new Prefect home's database starts from the migrated template when there is one (flows/local/templates.py): its
    server then starts in about 3.5 s instead of 9. Not when the user names another database. Returns the settings
    for the server's first start on it: the template is this Prefect release's schema with its block types registered,
    so that start skips both checks (later starts make them as usual)."""
    from flows.local.templates import seed

    if any(os.environ.get(k) for k in ("PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL")):
        return {}
    if not seed(home() / "prefect.db", "prefect"):
        return {}
    skip = {"PREFECT_SERVER_DATABASE_MIGRATE_ON_START": "false", "PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "false"}
    return {k: v for k, v in skip.items() if k not in os.environ}


def server_env(secret: str) -> dict[str, str]:
    """The environment of a local server: the user's, with the API's secret, and no pointer at another server."""
    env = {k: v for k, v in os.environ.items() if k not in POINTER_VARIABLES}
    env["PREFECT_SERVER_API_AUTH_STRING"] = secret
    return env


def spawn(secret: str) -> dict:
    """Start the watchdog (which starts the server) detached from this process, and record it; nothing waits.
    The port is bound here and handed down to the server. A new Prefect home starts from the migrated template
    database when there is one (flows/local/templates.py)."""
    private_home()
    first = seed_home()
    sock = reserve()
    port = sock.getsockname()[1]
    url = api_url(port)
    log = private.open_private(home() / "trtforge-server.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        watchdog = subprocess.Popen([sys.executable, "-m", "flows.local.server", "serve", str(port), str(sock.fileno())],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, pass_fds=(sock.fileno(),),
                                    cwd=str(Path(__file__).resolve().parents[2]), env={**server_env(secret), **first})
    finally:
        os.close(log)
        sock.close()
    st = {"pid": watchdog.pid, "port": port, "url": url, "started": time.time()}  # ("url": for people; never read)
    private.write_private(state_file(), json.dumps(st))
    return st


def pointed() -> bool:
    """Whether this process's Prefect was pointed at the shared server by begin() (not by the user's
    PREFECT_API_URL): a process started from here gets the user's environment, without it."""
    return _mine is not None


def without_heartbeats():
    """Prefect's flow-run heartbeats off for a build's flow, unless the user sets PREFECT_FLOWS_HEARTBEAT_FREQUENCY:
    the heartbeat thread sleeps in whole seconds and is joined when the flow ends (about a second per build, measured
    in benchmarks/bench_build.py); trtforge detects killed builds itself (their leases and MLflow runs). A user whose
    automations watch heartbeats (zombie flow runs) sets the variable and gets them back."""
    if any(os.environ.get(k) for k in ("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "PREFECT_RUNNER_HEARTBEAT_FREQUENCY")):
        return contextlib.nullcontext()
    from prefect.context import SettingsContext, get_settings_context

    # the current settings with one field changed, copied (Prefect's temporary_settings builds and validates the whole
    # Settings again from every source: about 0.2-0.4 s of a build's first flow)
    current = get_settings_context()
    s = current.settings
    settings = s.model_copy(update={"flows": s.flows.model_copy(update={"heartbeat_frequency": None})})
    return SettingsContext(profile=current.profile, settings=settings)


def busy() -> bool:
    """Whether a live build holds a lease (dead builds' leases are removed)."""
    live = False
    for f in lease_dir().glob("*"):
        if f.name.isdigit() and pid_alive(int(f.name)):
            live = True
        else:
            f.unlink(missing_ok=True)
    return live


def serve(port: int, fd: int | None = None) -> int:
    """The watchdog: run the Prefect server on 127.0.0.1:port (on the socket `fd`, bound by the build that started
    this); stop it after IDLE_SECONDS without a live lease."""
    import signal

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    me = os.getpid()  # the server gets SIGTERM when this watchdog dies, however it dies
    server = subprocess.Popen(server_command(port, fd), env=env, stdin=subprocess.DEVNULL,
                              preexec_fn=lambda: private.die_with_parent(me), pass_fds=(fd,) if fd is not None else ())
    if fd is not None:
        os.close(fd)  # the server holds it now

    def stop(*_):
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
        st = read_record()
        if st is not None and st["pid"] == os.getpid():
            state_file().unlink(missing_ok=True)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not healthy(f"http://127.0.0.1:{port}/api", timeout=1.0) and server.poll() is None:
        time.sleep(0.25)  # idle time counts from when builds can use it
    last_used = time.monotonic()
    while server.poll() is None:
        time.sleep(min(5.0, max(0.5, IDLE_SECONDS / 10)))
        if busy():
            last_used = time.monotonic()
        elif time.monotonic() - last_used > IDLE_SECONDS:
            stop()
    return server.returncode or 0


def shutdown(prefect_home: Path | None = None) -> bool:
    """Stop the shared server of this (or that) Prefect home now (tests, benchmarks, `make clean`); True when one was
    running."""
    record = (prefect_home / "trtforge-server.json") if prefect_home else state_file()
    st = read_record(record)
    if st is None:
        return False
    pid = st["pid"]
    if not pid_alive(pid):
        record.unlink(missing_ok=True)
        return False
    import signal

    os.kill(pid, signal.SIGTERM)
    for _ in range(80):
        if not pid_alive(pid):
            break
        time.sleep(0.25)
    return True


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "serve":
        sys.exit(serve(int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None))
    if len(sys.argv) >= 2 and sys.argv[1] == "stop":
        print("stopped" if shutdown() else "no server was running")
        sys.exit(0)
    print("usage: python -m flows.local.server serve PORT | stop", file=sys.stderr)
    sys.exit(2)
