"""What a build leaves running serves only its own user: checked as other local users (made with useradd; the suite
runs as root in CI, and acts as them with setpriv). A runtime folder another user made first is refused and nothing is
written through its links; the warm process's socket refuses other users (and its CLI refuses another user's
listener); the local Prefect API answers other users 401. Real users, real builds, real sockets and servers."""
from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import make_conv_model

REPO = Path(__file__).resolve().parents[2]
USER = "trtforge-peer"  # the user whose builds are checked
SQUATTER = "nobody"  # another user, who tries to get at them


def _account(name: str, create: bool) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    if create:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                       capture_output=True, timeout=60)
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


@pytest.fixture(scope="module")
def users():
    if os.geteuid() != 0:
        pytest.skip("needs root, to make a second local user and act as it (useradd, setpriv)")
    if not shutil.which("setpriv") or not shutil.which("useradd"):
        pytest.skip("needs setpriv and useradd (util-linux, passwd) to act as another local user")
    peer, squatter = _account(USER, create=True), _account(SQUATTER, create=False)
    if peer is None or squatter is None:
        pytest.skip(f"could not make the local user {USER} (useradd refused), or there is no user {SQUATTER}")
    # this checkout's interpreter may live where other users cannot reach (a venv of root's pyenv, as on the CI host):
    # then the user's own builds run with CAP_DAC_READ_SEARCH, which lets them read (never write) root's files; the
    # other user's probes never get it
    version = "import sys, flows.local.daemon, prefect.server.api.server; print(tuple(sys.version_info[:3]))"
    ours = str(tuple(sys.version_info[:3]))
    for caps in (False, True):
        probe = as_user(peer, [sys.executable, "-c", version], {"HOME": "/", "PATH": "/usr/bin:/bin"}, caps=caps)
        if probe.returncode == 0 and probe.stdout.strip() == ours:
            PEER_CAPS[peer.pw_uid] = caps
            return peer, squatter
    pytest.skip(f"{USER} cannot run this checkout's interpreter ({probe.stderr.strip()[-200:]})")


PEER_CAPS: dict[int, bool] = {}


def as_user(user: pwd.struct_passwd, args: list[str], env: dict, cwd: Path | str = "/", wait: bool = True,
            caps: bool | None = None, **kw):
    caps = PEER_CAPS.get(user.pw_uid, False) if caps is None else caps
    cmd = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
           *(["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"] if caps else []), "--", *args]
    if not wait:
        return subprocess.Popen(cmd, env=env, cwd=cwd, **kw)
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600, **kw)


@pytest.fixture()
def shared():
    """A folder every user can reach (like /tmp: sticky, world-writable), removed after the test."""
    d = Path(tempfile.mkdtemp(prefix="trtforge-shared-", dir="/tmp"))
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def home_of(user: pwd.struct_passwd, shared: Path, cache: Path | None = None) -> tuple[Path, dict]:
    """A home for the user in `shared` (theirs, 0700) with a tiny model and config, and the environment of its builds."""
    home = shared / f"home-{user.pw_name}"
    (home / "conf" / "model").mkdir(parents=True)
    make_conv_model(home / "tiny.onnx")
    (home / "conf" / "model" / "tiny.yaml").write_text(
        f"name: tiny\nformat: onnx\nsource: {home / 'tiny.onnx'}\n"
        "profiles:\n  - x: {min: [1, 3, 8, 8], opt: [2, 3, 16, 16], max: [4, 3, 32, 32]}\n")
    subprocess.run(["chown", "-R", f"{user.pw_uid}:{user.pw_gid}", str(home)], check=True)
    home.chmod(0o700)
    keep = ("PATH", "LANG", "LC_ALL", "PREFECT_SERVER_ANALYTICS_ENABLED", "MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "PREFECT_LOGGING_LEVEL")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(HOME=str(home), USER=user.pw_name, LOGNAME=user.pw_name, TRTFORGE_DAEMON="1",
               XDG_CACHE_HOME=str(cache or home / ".cache"), PREFECT_HOME=str(home / "prefect"),
               MLFLOW_TRACKING_URI=f"sqlite:///{home / 'mlflow.db'}", TRTFORGE_DAEMON_IDLE="120",
               TRTFORGE_SERVER_IDLE="120")
    return home, env


def build(user, home: Path, env: dict, *extra: str):
    return as_user(user, [sys.executable, "-m", "flows.build", "--config-dir", str(home / "conf"), "model=tiny",
                          "stages.benchmark=false", f"out_dir={home / 'out'}", f"cache_dir={home / 'cache'}",
                          "precision=fp32", *extra], env, cwd=home)


def identity_of(user, env: dict) -> str:
    code = "from flows.local.daemon import identity; print(identity())"
    r = as_user(user, [sys.executable, "-c", code], env)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def processes_of(uid: int, word: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and d.stat().st_uid == uid and word.encode() in (d / "cmdline").read_bytes():
                found.append(int(d.name))
        except OSError:
            continue
    return found


def stop_everything(user, env: dict) -> None:
    """The user's warm processes and shared Prefect server, stopped by the test that started them."""
    from flows.local.server import shutdown

    for pid in processes_of(user.pw_uid, "flows.local.warm"):
        os.kill(pid, signal.SIGTERM)
    shutdown(Path(env["PREFECT_HOME"]))


@pytest.mark.slow
def test_a_runtime_folder_squatted_before_the_first_build_is_refused_and_nothing_is_written_through_it(users, shared):
    peer, squatter = users
    cache = shared / "cache"  # the user's cache in a shared place (as /tmp was): another user can make it first
    home, env = home_of(peer, shared, cache=cache)
    ident = identity_of(peer, env)
    # the squatter makes the folders first, open to all, with links at the names a warm process writes
    victim_files = {name: home / name for name in ("log-target", "pid-target")}
    for f in victim_files.values():
        f.write_text("the user's own data\n")
        os.chown(f, peer.pw_uid, peer.pw_gid)
    before = {n: (f.read_bytes(), f.stat().st_mtime_ns) for n, f in victim_files.items()}
    plant = (f"import os; d = {str(cache / 'trtforge' / 'run')!r}; os.umask(0); os.makedirs(d, 0o777); "
             f"os.makedirs({str(cache / 'trtforge' / 'private')!r}, 0o777); "
             f"os.symlink({str(victim_files['log-target'])!r}, d + '/{ident}.log'); "
             f"os.symlink({str(victim_files['pid-target'])!r}, d + '/{ident}.pid')")
    r = as_user(squatter, [sys.executable, "-c", plant], {"PATH": "/usr/bin:/bin"}, cwd="/")
    assert r.returncode == 0, r.stderr
    try:
        first = build(peer, home, env)
        assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
        assert "ok in" in first.stdout
        run = cache / "trtforge" / "run"
        assert f"trtforge: warning: {run} belongs to uid {squatter.pw_uid}" in first.stderr, first.stderr
        assert "the build runs in its own process" in first.stderr
        time.sleep(3)  # a warm process would have been started by now
        assert not processes_of(peer.pw_uid, "flows.local.warm"), "a warm process started in a squatted folder"
        assert sorted(p.name for p in run.iterdir()) == sorted([f"{ident}.log", f"{ident}.pid"])  # nothing added
        assert {n: (f.read_bytes(), f.stat().st_mtime_ns) for n, f in victim_files.items()} == before
        assert not list((cache / "trtforge" / "private").iterdir())  # no secret written where others can read it
    finally:
        stop_everything(peer, env)


@pytest.mark.slow
def test_the_warm_process_serves_only_its_own_user_and_its_cli_talks_only_to_its_own(users, shared):
    peer, squatter = users
    home, env = home_of(peer, shared)
    try:
        first = build(peer, home, env)  # no warm process yet: builds itself, then starts one
        assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
        ident = identity_of(peer, env)
        run = home / ".cache" / "trtforge" / "run"
        sock = run / f"{ident}.sock"
        deadline = time.monotonic() + 180
        while not sock.exists():
            assert time.monotonic() < deadline, "no warm process came up"
            time.sleep(0.2)
        st = os.lstat(run)
        assert (st.st_uid, st.st_mode & 0o777) == (peer.pw_uid, 0o700)

        # another user cannot even reach the socket
        probe = (f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({str(sock)!r})")
        r = as_user(squatter, [sys.executable, "-c", probe], {"PATH": "/usr/bin:/bin"})
        assert r.returncode != 0 and "PermissionError" in r.stderr, r.stderr
        # one who can (root passes any folder) is refused by the warm process itself (SO_PEERCRED), and nothing runs
        out_r, out_w = os.pipe()
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(str(sock))
        request = {"argv": ["--cfg"], "cwd": "/", "env": {"PATH": "/usr/bin"}, "started": time.time()}
        try:
            socket.send_fds(c, [json.dumps(request).encode() + b"\n"], [0, out_w, out_w])
        except OSError:
            pass  # closed before the request got there: refused all the same
        c.settimeout(30)
        try:
            answer = c.recv(100)
        except OSError:
            answer = b""
        c.close()
        os.close(out_w)
        assert answer == b""  # no "pid": nothing was forked
        assert os.read(out_r, 100) == b""  # nothing ran with the descriptors handed over
        os.close(out_r)
        log = (run / f"{ident}.log").read_text()
        assert "refused a connection from uid 0" in log and " build " not in log, log

        second = build(peer, home, env, "target=sm_80")  # the user's own next build is served warm
        assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
        assert " build " in (run / f"{ident}.log").read_text()

        # a listener of another user's at the socket's name: the CLI refuses it and builds itself
        squat = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = run / ".planted.sock"
        squat.bind(str(tmp))
        tmp.chmod(0o666)  # connectable by anyone who reaches it
        squat.listen(4)
        os.replace(tmp, sock)  # (root can write in the user's folder; the warm process gives up its taken name)
        squat.settimeout(120)
        third = build(peer, home, env, "target=sm_89")
        assert third.returncode == 0, third.stdout[-2000:] + third.stderr[-2000:]
        assert f"{sock} is served by uid 0, not by this user" in third.stderr, third.stderr
        conn, _ = squat.accept()
        conn.settimeout(10)
        assert conn.recv(100) == b""  # it connected, saw whose listener it was, and sent nothing
        conn.close()
        squat.close()
        sock.unlink(missing_ok=True)
    finally:
        stop_everything(peer, env)


@pytest.mark.slow
def test_the_local_prefect_api_answers_other_users_401(users, shared):
    peer, squatter = users
    home, env = home_of(peer, shared)
    code = "from flows.local import server; print(server.ensure()); import sys; sys.stdout.flush()"
    try:
        r = as_user(peer, [sys.executable, "-c", code], env, cwd=home)
        assert r.returncode == 0, r.stderr
        url = r.stdout.strip().splitlines()[-1]
        secret_file = home / ".cache" / "trtforge" / "private" / "prefect-api-auth"
        st = os.lstat(secret_file)
        assert (st.st_uid, st.st_mode & 0o777) == (peer.pw_uid, 0o600)
        probe = (
            "import json, sys, urllib.request, urllib.error\n"
            "def status(path, body=None):\n"
            "    req = urllib.request.Request(sys.argv[1] + path, data=body, method='POST' if body else 'GET',\n"
            "                                 headers={'Content-Type': 'application/json'})\n"
            "    try:\n"
            "        with urllib.request.urlopen(req, timeout=10) as r: return r.status\n"
            "    except urllib.error.HTTPError as e: return e.code\n"
            "print(json.dumps([status('/health'), status('/admin/version'), status('/flow_runs/filter', b'{}'),\n"
            "                  status('/flows/', json.dumps({'name': 'intruder'}).encode())]))\n"
            "try:\n"
            f"    open({str(secret_file)!r}).read(); print('read')\n"
            "except PermissionError: print('denied')\n")
        r = as_user(squatter, [sys.executable, "-c", probe, url], {"PATH": "/usr/bin:/bin"})
        assert r.returncode == 0, r.stderr
        statuses, secret = r.stdout.split("\n")[:2]
        assert json.loads(statuses) == [200, 401, 401, 401]  # alive, and closed to them
        assert secret == "denied"
        from flows.local.net import auth_header

        own = urllib.request.Request(url + "/admin/version", headers=auth_header(secret_file.read_text().strip()))
        with urllib.request.urlopen(own, timeout=10) as resp:  # the user's own builds get in
            assert resp.status == 200
    finally:
        stop_everything(peer, env)
