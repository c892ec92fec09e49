"""The farm as two hosts: a user's own ONNX model with external weights, calibration data and a metric module, submitted
from a third directory to two workers that share no folder (each its own HOME, Prefect home, cache and working dir),
one Prefect server and one MLflow server with authentication. The files travel through the MLflow server's artifact
store, the int8 search runs once for both targets, and a worker killed while it holds a cache entry's lease does not
block the next build."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest

from tasks.common import ConfigError
from tests.flows.test_farm import mlflow_get, start_mlflow_with_basic_auth, stop, stop_farm
from tests.flows.test_serve import api, free_port
from tests.tasks.accuracy.test_metric import MINORITY, make_softmax_classifier

PROFILE = "profiles:\n  - x: {min: [1, 3, 16, 16], opt: [4, 3, 16, 16], max: [8, 3, 16, 16]}\n"
SLOW = '''
import os
import time


def sleepy(outputs, references, feeds):  # a metric that takes its time on the worker told so (the one killed)
    if os.environ.get("FARM_TEST_SLOW_METRIC"):
        time.sleep(600)
    return 1.0, True
'''


def user_dir(root: Path) -> Path:
    """The submitter's folder: conf/model/mine.yaml naming models/mine.onnx (its weights in mine.onnx.data), the
    metric modules in the working dir (not the config dir), calibration data as an .npz."""
    import onnx

    (root / "conf" / "model").mkdir(parents=True)
    (root / "models").mkdir()
    m = make_softmax_classifier(root / "models" / "mine.onnx")
    onnx.save(onnx.load(str(m)), str(m), save_as_external_data=True, all_tensors_to_one_file=True,
              location="mine.onnx.data", size_threshold=0)
    (root / "conf" / "model" / "mine.yaml").write_text(f"name: mine\nformat: onnx\nsource: models/mine.onnx\n{PROFILE}")
    (root / "minority.py").write_text(MINORITY)
    (root / "slow_metric.py").write_text(SLOW)
    np.savez(root / "cal.npz", x=np.random.default_rng(1).standard_normal((12, 3, 16, 16)).astype(np.float32))
    return root


def test_submit_refuses_a_missing_file_naming_the_key(tmp_path, monkeypatch):
    from flows.config import compose_config
    from flows.farmship import collect

    root = user_dir(tmp_path / "user")
    monkeypatch.chdir(root)
    conf = str(root / "conf")
    items = collect(compose_config(["model=mine", "calibration.data=cal.npz",
                                    "accuracy.metric=minority:relative_error"], conf), conf)
    shipped = {i.key: sorted(i.files) for i in items}
    assert shipped["model.source"] == ["mine.onnx", "mine.onnx.data"]  # the external weights travel with the model
    assert shipped["accuracy.metric"] == ["minority.py"] and shipped["calibration.data"] == ["cal.npz"]
    assert shipped["--config-dir"] == ["model/mine.yaml"]
    (root / "conf" / "results" / "mine").mkdir(parents=True)  # results and a cache kept inside the config dir
    (root / "conf" / "results" / "mine" / "engine.plan").write_bytes(b"a result")
    (root / "conf" / ".trtforge" / "cache").mkdir(parents=True)
    (root / "conf" / ".trtforge" / "cache" / "x.onnx").write_bytes(b"a cache entry")
    whole = {i.key: i.files for i in collect(compose_config(["model=mine", "out_dir=conf/results"], conf), conf)}
    assert whole["--config-dir"] == ["model/mine.yaml"]  # without the build's own results
    with pytest.raises(ConfigError, match="calibration.data='nope.npz'"):
        collect(compose_config(["model=mine", "calibration.data=nope.npz"], conf), conf)
    (root / "models" / "mine.onnx.data").unlink()
    with pytest.raises(ConfigError, match="mine.onnx.data"):
        collect(compose_config(["model=mine"], conf), conf)


def start_worker(root: Path, env: dict, name: str, extra: dict | None = None) -> subprocess.Popen:
    """A worker as on a host of its own: HOME, Prefect home, XDG cache and working dir under `root`, nothing shared."""
    root.mkdir(parents=True, exist_ok=True)
    e = {**env, "HOME": str(root), "PREFECT_HOME": str(root / ".prefect"), "XDG_CACHE_HOME": str(root / ".cache"),
         "XDG_RUNTIME_DIR": str(root / "run"), "TMPDIR": str(root / "tmp"), **(extra or {})}
    (root / "run").mkdir(mode=0o700, exist_ok=True)
    (root / "tmp").mkdir(mode=0o700, exist_ok=True)  # Prefect's runner keeps its attempt folders there
    prefect = str(Path(sys.executable).with_name("prefect"))
    return subprocess.Popen([prefect, "worker", "start", "--pool", "trtforge-rtx", "--name", name, "--limit", "1"],
                            env=e, cwd=root, stdout=open(root / "worker.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def kill_host(p: subprocess.Popen) -> None:
    """SIGKILL a worker and every process under it, as when its host dies (a flow run has a session of its own)."""
    def children(pid: int) -> list[int]:
        out = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(stat.parent.name))
        return out

    tree, todo = [], [p.pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children(pid)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait(10)


def held_leases(url: str) -> list[dict]:
    return [c for c in api(url, "/v2/concurrency_limits/filter", {"limit": 200})
            if c["name"].startswith("trtforge-cache-") and c["active_slots"] > 0]


@pytest.mark.slow
def test_two_hosts_build_a_users_model_calibrating_once_and_survive_a_killed_worker(tmp_path):
    import secrets

    from flows.serve import ensure_server

    port, mlflow_port, password = free_port(), free_port(), secrets.token_urlsafe(16)
    mlflow_url = f"http://127.0.0.1:{mlflow_port}"
    (tmp_path / "mlflow").mkdir()
    tracking = start_mlflow_with_basic_auth(tmp_path / "mlflow", mlflow_port, password)
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), MLFLOW_TRACKING_URI=mlflow_url,
               MLFLOW_TRACKING_USERNAME="admin", MLFLOW_TRACKING_PASSWORD=password,
               PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="1",
               PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS="1",  # expired leases are taken back at once
               TRTFORGE_FARM_LEASE_SECONDS="60", TRTFORGE_FARM_WAIT_SECONDS="600")
    import mlflow

    old, old_uri = dict(os.environ), mlflow.get_tracking_uri()
    os.environ.update(env)
    os.environ.pop("PREFECT_API_URL", None)
    mlflow.set_tracking_uri(mlflow_url)  # this process's calls too (an in-process build earlier set its own store)
    server, workers = None, []
    user = user_dir(tmp_path / "user")
    try:
        url, server = ensure_server(port)
        env["PREFECT_API_URL"] = os.environ["PREFECT_API_URL"] = url
        env["PREFECT_API_AUTH_STRING"] = os.environ["PREFECT_API_AUTH_STRING"]
        deadline = time.monotonic() + 180
        while mlflow_get(mlflow_url, "/health", None)[0] != 200:
            assert tracking.poll() is None and time.monotonic() < deadline, "mlflow server did not start"
            time.sleep(1)
        subprocess.run([sys.executable, "-m", "flows.farm", "setup"], env=env, check=True, cwd=tmp_path, timeout=300)
        workers = [start_worker(tmp_path / "host_a", env, "a"), start_worker(tmp_path / "host_b", env, "b")]
        common = ["model=mine", "precision=int8", "calibration.data=cal.npz", "stages.benchmark=false",
                  "accuracy.metric=minority:relative_error", "accuracy.greater_is_better=false"]
        # the sweep from the user's folder: relative paths are the submitter's; one flow run per target, one table
        sweep = subprocess.run([sys.executable, "-m", "flows.farm", "submit", "-m", "--config-dir", "conf",
                                "target=sm_86,sm_89", *common], env=env, cwd=user, capture_output=True, text=True,
                               timeout=900)
        assert sweep.returncode == 0, sweep.stdout + sweep.stderr
        print(sweep.stdout)  # (the table, with -s)
        lines = sweep.stdout.splitlines()
        header = next(i for i, line in enumerate(lines) if line.startswith("build"))
        rows = lines[header + 1:header + 3]
        assert all(" ok " in r for r in rows), sweep.stdout

        from flows.farmstore import FarmStore
        from flows.farm import farm_settings

        store = FarmStore(farm_settings()["store"])
        results = [store.get_json(f"runs/{n}") for n in sorted(store.names("runs"))]
        assert sorted(r["target"] for r in results) == ["sm_86", "sm_89"]
        # each worker built in its own folders, reading only what it fetched (nothing of the user's folder)
        outs = sorted(Path(r["out_dir"]).relative_to(tmp_path).parts[0] for r in results)
        assert outs == ["host_a", "host_b"], outs
        for r in results:
            summary = json.loads((Path(r["out_dir"]) / "summary.json").read_text())
            read = [f["path"] for f in summary["inputs"]["files"]]
            assert any(p.endswith("mine.onnx.data") for p in read) and not any(str(user) in p for p in read), read
        # the int8 search (the Q/DQ graph) ran once: the other worker fetched it, and says where it came from
        assert len(store.names("cache/calibrate-qdq")) == 1
        cal = {r["target"]: r["stages"]["calibrate"] for r in results}
        reused = [t for t, c in cal.items() if c.get("cached_from")]
        assert len(reused) == 1, cal
        assert cal[reused[0]]["reason"] == "partly from the cache (1 of 2 outputs)"  # its engine is its own target's
        computed = next(t for t in cal if t not in reused)
        assert "run" in cal[reused[0]]["cached_from"] and "cached_from" not in cal[computed]
        # both engines registered, through MLflow's authentication
        code, found = mlflow_get(mlflow_url, "/api/2.0/mlflow/registered-models/get?name=mine", ("admin", password))
        assert code == 200 and {a["alias"] for a in found["registered_model"]["aliases"]} == {"sm_86-int8", "sm_89-int8"}

        # the scheduled rebuild on the farm re-resolves both as submitted (their shipped files and keys) and finds
        # them fresh: nothing is submitted
        from flows.rebuild import rebuild_pass
        cwd = os.getcwd()
        os.chdir(user)
        try:
            report = rebuild_pass(farm=True, log=lambda *_: None)
        finally:
            os.chdir(cwd)
        assert len(report["fresh"]) == 2 and not report["rebuilt"] and not report["failed"], report

        # a worker killed while it computes a cache entry (its metric never returns on that host) holds the entry's
        # lease; once it expires, another worker computes the entry and the build completes
        for w in workers:
            stop(w)
        before = store.names("cache/calibrate-qdq")
        slow = [*common[:-2], "accuracy.metric=slow_metric:sleepy", "target=sm_86"]
        workers = [start_worker(tmp_path / "host_c", env, "c", {"FARM_TEST_SLOW_METRIC": "1"})]
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        from flows.farm import submit, wait_for
        cwd = os.getcwd()
        os.chdir(user)
        try:
            with temporary_settings({PREFECT_API_URL: url, PREFECT_API_AUTH_STRING: env["PREFECT_API_AUTH_STRING"]}):
                first = submit(slow, "conf")
                deadline = time.monotonic() + 300
                while not any("calibrate-qdq" in c["name"] for c in held_leases(url)):
                    assert time.monotonic() < deadline, "the slow build never took the calibration's lease"
                    time.sleep(0.5)
                kill_host(workers[0])
                killed = datetime.now(timezone.utc).isoformat(timespec="seconds")
                workers.append(start_worker(tmp_path / "host_d", env, "d"))
                t0 = time.monotonic()
                second = submit(slow, "conf")
                done = wait_for([second], timeout=400)
        finally:
            os.chdir(cwd)
        assert done[second.id].state_type.value == "COMPLETED", done[second.id].state.message
        assert store.get_json(f"runs/{second.id}.json")["status"] == "ok"
        # the Q/DQ graph judged by the slow metric was computed after the kill, by the next worker
        new = store.names("cache/calibrate-qdq") - before
        assert len(new) == 1
        origin = store.get_json(f"cache/calibrate-qdq/{new.pop()}/result.json")["origin"]
        assert origin["at"] >= killed, (origin, killed)
        assert time.monotonic() - t0 < 300  # waited for the dead worker's lease to expire (60 s), not forever
        assert not held_leases(url)
        assert store.get_json(f"runs/{first.id}.json") is None  # the killed build left no result
    finally:
        stop_farm(workers, server, tracking, old, old_uri)


def test_a_worker_builds_from_checked_copies_at_paths_named_by_their_content(tmp_path, monkeypatch):
    """Upload once by sha256, fetch into the worker's workdir (checked), overrides and config dir pointing at the copies;
    a damaged blob is refused. The store here is a local MLflow artifact location (the farm's is its server's)."""
    from flows.config import compose_config
    from flows.farmship import blobs, collect, manifest_of, materialize, rewritten
    from flows.farmstore import FarmStore, FarmStoreError

    root = user_dir(tmp_path / "user")
    monkeypatch.chdir(root)
    ov = ["model=mine", "calibration.data=cal.npz", "accuracy.metric=minority:relative_error"]
    items = collect(compose_config(ov, "conf"), "conf")
    shipped = manifest_of(items)
    store = FarmStore((tmp_path / "store").as_uri())
    roots = {i.key: i.root for i in items}
    files = {sha: roots[key] / rel for sha, (key, rel) in blobs(shipped).items()}
    assert store.put_blobs(files) == 5 and FarmStore(store.uri).put_blobs(files) == 0  # once per content

    config_dir, extra = materialize(shipped, tmp_path / "worker", store.get_blob)
    cfg = compose_config(rewritten(ov, extra), config_dir)
    source = Path(cfg.model.source)
    assert source.parent.parent == tmp_path / "worker" / "items" and source.read_bytes() == (
        root / "models" / "mine.onnx").read_bytes()
    assert (source.parent / "mine.onnx.data").is_file()  # the weights beside the model, as it names them
    assert Path(cfg.calibration.data).parent.parent == tmp_path / "worker" / "items"
    assert (Path(config_dir) / "minority.py").resolve().read_text() == (root / "minority.py").read_text()
    assert (Path(config_dir) / "model" / "mine.yaml").is_file()
    again = materialize(shipped, tmp_path / "worker", store.get_blob)  # fetched once: the same places
    assert again == (config_dir, extra)

    sha = next(iter(shipped["items"][1]["files"].values()))
    blob = tmp_path / "store" / "blobs" / sha[:2] / sha
    assert not blob.is_symlink()  # a copy in the store, not a link to the user's file
    blob.write_bytes(b"not the model")
    with pytest.raises(FarmStoreError, match=sha):
        materialize(shipped, tmp_path / "other", store.get_blob)


def test_the_shared_cache_serves_one_workers_entry_to_another_with_its_reads_under_its_own_workdir(
        prefect_harness, tmp_path):
    """Worker A computes an entry whose stage read a fetched file; worker B (other cache, other workdir with the same
    file) is served A's upload, the record of what was read pointing into B's workdir; once B's copy differs, B
    recomputes. Each lease is let go (a real Prefect server: the session's)."""
    from prefect.client.orchestration import get_client

    from flows.farmstore import FarmStore, SharedStageCache, lease_name
    from tasks.common import StageResult

    store = FarmStore((tmp_path / "store").as_uri())
    calls = []

    def stage(workdir: Path):
        def fn(d: Path) -> StageResult:
            calls.append(workdir.name)
            data = (workdir / "items" / "abc" / "cal.npz").read_bytes()
            (d / "out.bin").write_bytes(data[::-1])
            return StageResult(files={"out": d / "out.bin"}, metrics={"n": len(data)})
        return fn

    caches = {}
    for name in ("a", "b"):
        (tmp_path / name / "items" / "abc").mkdir(parents=True)
        (tmp_path / name / "items" / "abc" / "cal.npz").write_bytes(b"the same calibration data")
        caches[name] = SharedStageCache(tmp_path / name / "cache", store, tmp_path / name, 60, 30)
    a, b = caches["a"], caches["b"]
    key = a.key("calibrate-qdq", {"x": 1})
    assert a.get("calibrate-qdq", key) is None  # nobody has it: A holds its lease and computes
    r = a.run("calibrate-qdq", key, stage(tmp_path / "a"), origin={"run": "A"})
    assert [e["path"] for e in r.deps["files"]] == [str(tmp_path / "a" / "items" / "abc" / "cal.npz")]
    hit = b.get("calibrate-qdq", key)
    assert calls == ["a"] and hit is not None and hit.origin["run"] == "A"
    assert [e["path"] for e in hit.deps["files"]] == [str(tmp_path / "b" / "items" / "abc" / "cal.npz")]
    assert hit.files["out"].read_bytes() == r.files["out"].read_bytes() and hit.files["out"].parent != r.files["out"].parent

    (tmp_path / "b" / "items" / "abc" / "cal.npz").write_bytes(b"other calibration data!!!")
    b2 = SharedStageCache(tmp_path / "b" / "cache", store, tmp_path / "b", 60, 30)
    assert b2.get("calibrate-qdq", key) is None and "changed" in b2.stale[("calibrate-qdq", key)]
    b2.run("calibrate-qdq", key, stage(tmp_path / "b"))
    assert calls == ["a", "b"]
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name(lease_name("calibrate-qdq", key)).active_slots == 0


def test_a_worker_refuses_a_folder_other_users_could_write_naming_the_setting_that_chose_it(tmp_path, monkeypatch):
    """The worker's folder holds the models it fetched and the modules a build imports: one another user could write
    is refused (exit 2) before anything is fetched, and the fix names the setting that chose the folder."""
    from flows.farm import farm_build
    from tasks.common.errors import ConfigError

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("TRTFORGE_FARM_WORKDIR", str(shared))
    with pytest.raises(ConfigError) as e:
        farm_build.fn(["model=ppocr_det"], farm={"store": (tmp_path / "store").as_uri()})
    assert "the farm worker's folder" in e.value.message and "other users" in e.value.message
    assert "TRTFORGE_FARM_WORKDIR" in e.value.fix and e.value.exit_code == 2
    assert not (tmp_path / "store").exists()  # nothing fetched nor written


def test_a_lease_shorter_than_prefect_allows_is_refused_naming_the_setting(monkeypatch):
    from flows.farm import MIN_LEASE_SECONDS, farm_settings
    from tasks.common.errors import ConfigError

    monkeypatch.setenv("TRTFORGE_FARM_LEASE_SECONDS", "30")
    with pytest.raises(ConfigError) as e:
        farm_settings()
    assert "lease_seconds=30" in e.value.message and str(MIN_LEASE_SECONDS) in e.value.fix
    monkeypatch.setenv("TRTFORGE_FARM_LEASE_SECONDS", str(MIN_LEASE_SECONDS))
    assert farm_settings()["lease_seconds"] == MIN_LEASE_SECONDS
