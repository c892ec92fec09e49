"""The folders a build keeps its own state in (PREFECT_HOME, the runtime and lock folders) are the user's own or the
build is refused (exit 2, naming the folder and the fix); no record there decides where the Prefect API's secret goes;
no link planted there is followed; `make serve`'s Prefect server ends with it however it ends. Checked as another
local user where the host allows it (root: useradd + setpriv, tests/flows/test_local_isolation.py), with real builds,
servers and listeners."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.local.net import free_port, listener_uid
from tests.flows.test_local_isolation import (as_user, build, home_of, shared, stop_everything,  # noqa: F401
                                              users)

REPO = Path(__file__).resolve().parents[2]

# a listener of the other user's that acts as an authenticated Prefect API (/health open, anything else 401 without an
# Authorization header, 200 with any) and writes down every request it gets, with its Authorization header: where a
# build that trusted a record would send the Prefect API's secret
LISTENER = r'''
import http.server, json, sys
log = sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def _any(self):
        n = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(n)
        with open(log, "a") as f:
            f.write(json.dumps({"path": self.path, "auth": self.headers.get("Authorization")}) + "\n")
        body = b'{"status": "ok"}'
        self.send_response(200 if self.path.endswith("/health") or self.headers.get("Authorization") else 401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
'''


@contextlib.contextmanager
def attacker_listener(user, shared_dir: Path):
    """The other user's listener on a free port: yields (port, pid, the requests it got so far)."""
    port, log = free_port(), shared_dir / "listener.log"
    proc = as_user(user, [sys.executable, "-c", LISTENER, str(port), str(log)], {"PATH": "/usr/bin:/bin"}, wait=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while listener_uid(port) != user.pw_uid:
        assert proc.poll() is None and time.monotonic() < deadline, "the other user's listener did not start"
        time.sleep(0.1)

    def got() -> list[dict]:
        return [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []

    try:
        yield port, proc.pid, got
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_prefect_home_another_user_can_write_is_refused_and_nothing_is_written_through_its_links(users, shared):
    peer, squatter = users
    home, env = home_of(peer, shared)
    victims = {n: home / n for n in ("log-target", "record-target")}
    for f in victims.values():
        f.write_text("the user's own data\n")
        os.chown(f, peer.pw_uid, peer.pw_gid)
    root_file = shared / "root-owned"  # a file the build's user cannot even write (root's)
    root_file.write_text("root's data\n")
    before = {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in (*victims.values(), root_file)}
    prefect_home = shared / "prefect-shared"  # a PREFECT_HOME in a shared place, made first by the other user
    with attacker_listener(squatter, shared) as (port, pid, got):
        record = {"pid": pid, "port": port, "url": f"http://127.0.0.1:{port}/api", "started": time.time()}
        plant = (f"import json, os; d = {str(prefect_home)!r}; os.umask(0); os.makedirs(d, 0o777); "
                 f"open(d + '/trtforge-server.json', 'w').write({json.dumps(record)!r}); "
                 f"os.symlink({str(victims['log-target'])!r}, d + '/trtforge-server.log'); "
                 f"os.symlink({str(home)!r}, d + '/trtforge-leases'); "
                 f"os.symlink({str(root_file)!r}, d + '/prefect.db'); "
                 f"[os.symlink({str(victims['record-target'])!r}, d + f'/.trtforge-server.json.{{p}}') "
                 f"for p in range(2, 4096, 97)]")
        r = as_user(squatter, [sys.executable, "-c", plant], {"PATH": "/usr/bin:/bin"})
        assert r.returncode == 0, r.stderr
        try:
            result = build(peer, home, {**env, "PREFECT_HOME": str(prefect_home), "TRTFORGE_DAEMON": "0"})
            assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
            assert f"PREFECT_HOME {prefect_home} belongs to uid {squatter.pw_uid}" in result.stderr, result.stderr
            assert "fix: " in result.stderr and "internal error" not in result.stderr
            assert not [q for q in got() if q["auth"]], got()  # the secret went nowhere
        finally:
            stop_everything(peer, {**env, "PREFECT_HOME": str(prefect_home)})
    assert {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in before} == before  # nothing written through a link
    assert not [p for p in home.iterdir() if p.name.isdigit()]  # no lease made through the linked lease folder


@pytest.mark.slow
def test_a_record_naming_another_address_never_gets_the_secret(users, shared):
    """The user's own PREFECT_HOME, its record rewritten (by whoever could: here root) to name the user's real port
    with another user's URL, or another user's port: the secret only ever goes to 127.0.0.1:<port> when the kernel
    says that listener is the user's and it requires and accepts the secret."""
    peer, squatter = users
    home, env = home_of(peer, shared)
    code = "from flows.local import server; print(server.ensure()); import sys; sys.stdout.flush()"
    state = home / "prefect" / "trtforge-server.json"
    try:
        r = as_user(peer, [sys.executable, "-c", code], env, cwd=home)
        assert r.returncode == 0, r.stderr
        real = json.loads(state.read_text())
        assert r.stdout.strip().splitlines()[-1] == f"http://127.0.0.1:{real['port']}/api"
        with attacker_listener(squatter, shared) as (port, _pid, got):
            # the builder's real port and watchdog, another URL: the URL is never read
            state.write_text(json.dumps({**real, "url": f"http://127.0.0.1:{port}/api"}))
            r = as_user(peer, [sys.executable, "-c", code], env, cwd=home)
            assert r.returncode == 0, r.stderr
            assert r.stdout.strip().splitlines()[-1] == f"http://127.0.0.1:{real['port']}/api"
            # the other user's port under the builder's live watchdog: not theirs, so a new server of the user's
            state.write_text(json.dumps({**real, "port": port, "url": f"http://127.0.0.1:{port}/api"}))
            r = as_user(peer, [sys.executable, "-c", code], env, cwd=home)
            assert r.returncode == 0, r.stderr
            url = r.stdout.strip().splitlines()[-1]
            assert url != f"http://127.0.0.1:{port}/api"
            assert listener_uid(int(re.search(r":(\d+)/api", url).group(1))) == peer.pw_uid
            assert not [q for q in got() if q["auth"]], got()
            with contextlib.suppress(OSError):
                os.kill(real["pid"], signal.SIGTERM)  # the first watchdog, no longer recorded
    finally:
        stop_everything(peer, env)


def _cli(tmp_path: Path, env_extra: dict, *overrides: str, user_config_dir: Path):
    env = {**os.environ, "TRTFORGE_DAEMON": "0", **env_extra}
    return subprocess.run([sys.executable, "-m", "flows.build", "--config-dir", str(user_config_dir), "model=tiny",
                           "precision=fp32", "stages.benchmark=false", f"out_dir={tmp_path / 'out'}",
                           f"cache_dir={tmp_path / 'cache'}", *overrides], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("prefect", ["shared", "ephemeral"])
def test_a_prefect_home_open_to_others_is_refused_with_exit_2_and_the_fix(tmp_path, user_config_dir, prefect):
    """Refused for the shared local server and for Prefect's own temporary one alike (both keep their database
    there)."""
    home = tmp_path / "prefect"
    home.mkdir()
    home.chmod(0o755)  # (an older Prefect made ~/.prefect so)
    extra = {"TRTFORGE_PREFECT": "ephemeral"} if prefect == "ephemeral" else {}
    r = _cli(tmp_path, {"PREFECT_HOME": str(home), **extra}, user_config_dir=user_config_dir)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"trtforge: error: PREFECT_HOME {home} has mode 0755, not 0700" in r.stderr
    assert f"fix: chmod 700 {home}" in r.stderr
    assert not (home / "trtforge-server.json").exists() and not (home / "prefect.db").exists()


def test_both_lock_folders_refused_is_a_clear_exit_2(tmp_path, user_config_dir):
    """The runtime folder and the fallback lock folder in $TMPDIR both open to others: bad input, named, with the fix
    (not "internal error: NotPrivate")."""
    run, tmp = tmp_path / "xdg", tmp_path / "tmp"
    for d in (run / "trtforge", tmp / f"trtforge-locks-{os.geteuid()}"):
        d.mkdir(parents=True)
        d.chmod(0o777)
    r = _cli(tmp_path, {"XDG_RUNTIME_DIR": str(run), "TMPDIR": str(tmp)}, user_config_dir=user_config_dir)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"trtforge: error: {run / 'trtforge'} has mode 0777, not 0700" in r.stderr, r.stderr
    assert f"fix: chmod 700 {run / 'trtforge'}" in r.stderr
    assert "internal error" not in r.stderr


def running(pid: int) -> bool:
    """Whether the process runs (a zombie nobody reaped yet has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_make_serve_killed_leaves_no_prefect_server(tmp_path, sig):
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    serve = subprocess.Popen([sys.executable, "-m", "flows.serve", f"port={port}"], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server = None
    try:
        deadline = time.monotonic() + 180
        while server is None:
            line = serve.stdout.readline()
            assert line or serve.poll() is None, "flows.serve ended before its server started"
            m = re.search(r"started here, pid (\d+)", line)
            server = int(m.group(1)) if m else None
            assert time.monotonic() < deadline, "flows.serve started no server"
        assert listener_uid(port) == os.geteuid()
        serve.send_signal(sig)
        serve.wait(timeout=30)
        deadline = time.monotonic() + 20
        while running(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not running(server), f"the Prefect server outlived flows.serve ended by {sig.name}"
        assert listener_uid(port) is None
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        if server is not None and running(server):
            os.kill(server, signal.SIGKILL)


def test_results_follow_the_users_umask_and_state_stays_private(tmp_path, user_config_dir):
    """One policy for modes: a result's files (whichever helper wrote them) and `summary_out` follow the user's umask;
    what trtforge keeps for itself (the server's record and log, its leases, the secret) is 0600 in 0700 folders."""
    home = tmp_path / "prefect"
    r = subprocess.run([sys.executable, "-m", "flows.build", "--config-dir", str(user_config_dir), "model=tiny",
                        "precision=fp32", "stages.benchmark=false", f"out_dir={tmp_path / 'out'}",
                        f"cache_dir={tmp_path / 'cache'}", f"summary_out={tmp_path / 'summary.json'}"],
                       cwd=tmp_path, env={**os.environ, "TRTFORGE_DAEMON": "0", "PREFECT_HOME": str(home)},
                       capture_output=True, text=True, timeout=600, preexec_fn=lambda: os.umask(0o027))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    result = Path(summary["out_dir"])
    modes = {str(f.relative_to(result)): f.stat().st_mode & 0o777 for f in result.rglob("*") if f.is_file()}
    assert {"summary.json", "report.html", summary["engine"]["file"]} <= set(modes)
    assert set(modes.values()) == {0o640}, modes
    assert (tmp_path / "summary.json").stat().st_mode & 0o777 == 0o640
    cached = [f for f in (tmp_path / "cache").rglob("result.json")]
    assert cached and {f.stat().st_mode & 0o777 for f in cached} == {0o640}
    for f in (home / "trtforge-server.json", home / "trtforge-server.log"):
        assert f.stat().st_mode & 0o777 == 0o600, f
    assert home.stat().st_mode & 0o777 == 0o700


def test_a_template_other_users_could_write_is_not_copied_into_a_new_database(tmp_path, monkeypatch):
    """The migrated templates (flows/local/templates.py) seed the user's new Prefect and MLflow databases: one in a
    folder others can write (a squatted ~/.cache/trtforge) could carry their records, so it is not used."""
    from flows.local.templates import seed, template

    src = template("mlflow")
    assert src is not None and src.is_file(), "no template (make setup makes them)"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    planted = template("mlflow")
    planted.parent.mkdir(parents=True)
    planted.write_bytes(src.read_bytes())
    planted.parent.chmod(0o777)
    assert not seed(tmp_path / "a.db", "mlflow") and not (tmp_path / "a.db").exists()
    planted.parent.chmod(0o755)
    assert seed(tmp_path / "b.db", "mlflow") and (tmp_path / "b.db").read_bytes() == src.read_bytes()
