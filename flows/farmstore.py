"""The farm's shared store and its leases: one place, reached through the farm's authentication, for the files a build
reads (content-addressed blobs), the stage cache every worker shares, and the short results a sweep prints.

The store is an MLflow artifact location (conf/farm.yaml `store`): by default `mlflow-artifacts:/trtforge-farm` on
the farm's tracking server (`mlflow server --serve-artifacts`, MLFLOW_TRACKING_USERNAME/PASSWORD for its basic auth),
or any location MLflow's artifact repositories reach (e.g. `s3://bucket/prefix` with the team's S3 credentials).

    blobs/<sha[:2]>/<sha256>          a shipped file (flows/farmship.py), uploaded once
    cache/<entry>/<key>/...           a stage cache entry (flows/cache.py's layout), result.json written last
    runs/<flow run id>.json           what a farm build returns (the sweep's table)

A cache entry that no worker has is computed by one worker: it holds a lease on a Prefect global concurrency limit of
one slot named after the entry, renewed while it computes and released when the entry is uploaded; another worker asking
for the entry waits for the lease, then fetches what the first uploaded. A worker that dies stops renewing: its lease
expires after `lease_seconds` and the next worker computes the entry.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from flows.cache import StageCache, locked, remove_dead_temps, temp_name
from tasks.common import StageResult, TrtforgeError, sha256_file

REPO = Path(__file__).resolve().parents[1]
FARM_PATH, CODE_PATH = "{farm}", "{code}"  # where a dependency record's paths lie, in the store's copy of an entry


class FarmStoreError(TrtforgeError):
    """The store refused or failed a request (credentials, address, network)."""


class FarmStore:
    def __init__(self, uri: str):
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        self.uri = uri.rstrip("/")
        try:
            self.repo = get_artifact_repository(self.uri)
        except Exception as e:  # noqa: BLE001 - an unknown scheme or an unset tracking server
            raise FarmStoreError(f"the farm store {uri!r} cannot be opened: {e}",
                                 fix="set store in conf/farm.yaml (or TRTFORGE_FARM_STORE) to mlflow-artifacts:/PATH "
                                     "with MLFLOW_TRACKING_URI pointing at the farm's MLflow server, or to s3://...")
        self._listed: dict[str, set[str]] = {}

    @contextlib.contextmanager
    def _request(self, what: str):
        try:
            yield
        except FarmStoreError:
            raise
        except Exception as e:  # noqa: BLE001 - MLflow raises its own, requests' and boto's errors
            raise FarmStoreError(f"the farm store {self.uri} failed to {what}: {type(e).__name__}: {str(e)[:300]}",
                                 fix="check MLFLOW_TRACKING_URI and MLFLOW_TRACKING_USERNAME/PASSWORD (or the S3 "
                                     "credentials) on this host") from e

    def names(self, folder: str) -> set[str]:
        with self._request(f"list {folder}"):
            return {Path(f.path).name for f in self.repo.list_artifacts(folder)}

    # --- blobs ------------------------------------------------------------------------------------------------
    def put_blobs(self, files: dict[str, Path]) -> int:
        """Upload the files (sha256 -> path) the store lacks; returns how many were uploaded."""
        sent = 0
        for sha, path in files.items():
            prefix = f"blobs/{sha[:2]}"
            if prefix not in self._listed:
                self._listed[prefix] = self.names(prefix)
            if sha in self._listed[prefix]:
                continue
            with _tempdir() as tmp, self._request(f"upload {path}"):
                (tmp / sha).symlink_to(Path(path).resolve())
                self.repo.log_artifact(str(tmp / sha), prefix)
            self._listed[prefix].add(sha)
            sent += 1
        return sent

    def get_blob(self, sha: str, dest: Path) -> None:
        """Download a blob to `dest` and check its sha256."""
        with _tempdir(dest.parent) as tmp, self._request(f"download blob {sha}"):
            got = Path(self.repo.download_artifacts(f"blobs/{sha[:2]}/{sha}", str(tmp)))
            if sha256_file(got) != sha:
                raise FarmStoreError(f"blob {sha} from the farm store {self.uri} does not match its sha256",
                                     fix="submit the build again (the submitter uploads it anew)")
            os.replace(got, dest)

    # --- small JSON documents ---------------------------------------------------------------------------------
    def put_json(self, path: str, data: Any) -> None:
        folder, _, name = path.rpartition("/")
        with _tempdir() as tmp, self._request(f"write {path}"):
            (tmp / name).write_text(json.dumps(data, indent=1, default=str))
            self.repo.log_artifact(str(tmp / name), folder or None)

    def get_json(self, path: str) -> Any | None:
        folder, _, name = path.rpartition("/")
        if name not in self.names(folder):
            return None
        with _tempdir() as tmp, self._request(f"read {path}"):
            return json.loads(Path(self.repo.download_artifacts(path, str(tmp))).read_text())

    # --- stage cache entries ----------------------------------------------------------------------------------
    def has_entry(self, entry: str, key: str) -> bool:
        return "result.json" in self.names(f"cache/{entry}/{key}")

    def put_entry(self, entry: str, key: str, folder: Path, meta: dict) -> None:
        """The entry's files, then its result.json (`meta`): a reader that sees result.json sees every file."""
        where = f"cache/{entry}/{key}"
        with self._request(f"upload {where}"):
            for p in sorted(folder.rglob("*")):
                if p.is_file() and p.name != "result.json":
                    rel = p.parent.relative_to(folder)
                    self.repo.log_artifact(str(p), where if str(rel) == "." else f"{where}/{rel}")
        self.put_json(f"{where}/result.json", meta)

    def get_entry(self, entry: str, key: str, dest: Path) -> dict | None:
        """Download an entry into the new folder `dest`; its result.json's content, or None when the store has none."""
        where = f"cache/{entry}/{key}"
        if not self.has_entry(entry, key):
            return None
        with _tempdir(dest.parent) as dl, self._request(f"download {where}"):
            os.replace(self.repo.download_artifacts(where, str(dl)), dest)
        return json.loads((dest / "result.json").read_text())


@contextlib.contextmanager
def _tempdir(parent: Path | None = None):
    import tempfile

    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=".farm-", dir=parent))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# --- leases --------------------------------------------------------------------------------------------------

def lease_name(entry: str, key: str) -> str:
    return f"trtforge-cache-{entry}-{key[:32]}"


@contextlib.contextmanager
def lease(name: str, lease_seconds: float, wait_seconds: float):
    """Hold the one slot of the Prefect global concurrency limit `name` (created on first use): renewed while held,
    released on exit, expired by the server `lease_seconds` after a holder died. TrtforgeError after `wait_seconds`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists

    import httpx

    with get_client(sync_client=True) as client:
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        except (ObjectAlreadyExists, httpx.HTTPStatusError):  # made meanwhile by another worker (a 409, or the
            pass                                              # server's 500 on the race); strict=True below checks
    try:
        cm = concurrency(name, occupy=1, timeout_seconds=wait_seconds, lease_duration=lease_seconds, strict=True,
                          raise_on_lease_renewal_failure=False)  # (a lost lease costs a duplicate computation)
        cm.__enter__()
    except TimeoutError as e:
        raise TrtforgeError(f"waited {wait_seconds:g} s for the farm lease {name}: another worker is still computing "
                            "this cache entry", fix="raise wait_seconds in conf/farm.yaml, or look at that worker's "
                                                    "flow run (its lease expires when it dies)") from e
    try:
        yield
    finally:
        cm.__exit__(None, None, None)


# --- the shared stage cache ----------------------------------------------------------------------------------

class SharedStageCache(StageCache):
    """flows/cache.py's StageCache, with the farm's store behind it: a local miss is fetched from the store, or
    computed here under the entry's lease and uploaded. Keys are the local cache's."""

    def __init__(self, root: str | os.PathLike, store: FarmStore, workdir: Path, lease_seconds: float,
                 wait_seconds: float):
        super().__init__(root)
        self.store, self.workdir = store, Path(os.path.realpath(workdir))
        self.lease_seconds, self.wait_seconds = lease_seconds, wait_seconds
        self._held: dict[tuple[str, str], contextlib.ExitStack] = {}
        self.fetched: list[tuple[str, str]] = []  # entries this process took from the store

    def get(self, stage: str, key: str) -> StageResult | None:
        """The local entry, else the store's; else None, holding the entry's lease (its `run` computes it and lets go):
        a worker computing the entry meanwhile is waited for, and its upload served."""
        hit = super().get(stage, key) or self._fetch(stage, key)
        if hit is not None or (stage, key) in self._held:
            return hit
        stack = contextlib.ExitStack()
        stack.enter_context(lease(lease_name(stage, key), self.lease_seconds, self.wait_seconds))
        try:
            hit = self._fetch(stage, key)  # computed by the worker that held the lease while this one waited
        except BaseException:
            stack.close()
            raise
        if hit is not None:
            stack.close()
        else:
            self._held[(stage, key)] = stack
        return hit

    def run(self, stage: str, key: str, fn: Callable[[Path], StageResult], origin: dict | None = None) -> StageResult:
        if (stage, key) not in self._held:
            hit = self.get(stage, key)
            if hit is not None:
                return hit
        stack = self._held.pop((stage, key))
        with stack:
            with locked(self.root / ".locks" / f"{stage}-{key}.lock"):
                hit = StageCache.get(self, stage, key)
                if hit is None:
                    hit = self._compute(stage, key, fn, origin)
                    self._upload(stage, key)
            return hit

    def annotate(self, stage: str, key: str, origin: dict) -> None:
        super().annotate(stage, key, origin)
        if (stage, key) in self.fetched:
            return
        meta = self.entry(stage, key) / "result.json"
        if meta.is_file():  # later builds on other workers say which run measured it
            self.store.put_json(f"cache/{stage}/{key}/result.json", self._portable(json.loads(meta.read_text())))

    def release(self) -> None:
        """Let go of every lease still held (a stage that failed between its lookup and its computation)."""
        while self._held:
            self._held.popitem()[1].close()

    def _upload(self, stage: str, key: str) -> None:
        d = self.entry(stage, key)
        self.store.put_entry(stage, key, d, self._portable(json.loads((d / "result.json").read_text())))

    def _fetch(self, stage: str, key: str) -> StageResult | None:
        with locked(self.root / ".locks" / f"{stage}-{key}.lock"):
            hit = StageCache.get(self, stage, key)
            if hit is not None or not self.store.has_entry(stage, key):
                return hit
            remove_dead_temps(self.root / ".tmp")
            tmp = self.root / ".tmp" / temp_name(stage)
            tmp.parent.mkdir(parents=True, exist_ok=True)
            try:
                meta = self.store.get_entry(stage, key, tmp)
                if meta is None:
                    return None
                (tmp / "result.json").write_text(json.dumps(self._local(meta), indent=1))
                final = self.entry(stage, key)
                final.parent.mkdir(parents=True, exist_ok=True)
                if final.exists():  # a stale local entry
                    shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            self.stale.pop((stage, key), None)
            hit = StageCache.get(self, stage, key)
            if hit is not None:
                self.fetched.append((stage, key))
            return hit

    def _portable(self, meta: dict) -> dict:
        """The entry's record with the paths of what it read under this worker's farm workdir and trtforge checkout
        written relative to them: another worker finds the same files under its own."""
        roots = ((str(self.workdir), FARM_PATH), (os.path.realpath(REPO), CODE_PATH))
        return _rewrite(meta, roots)

    def _local(self, meta: dict) -> dict:
        return _rewrite(meta, ((FARM_PATH, str(self.workdir)), (CODE_PATH, os.path.realpath(REPO))))


def _rewrite(meta: dict, roots: tuple[tuple[str, str], ...]) -> dict:
    files = []
    for e in (meta.get("deps") or {}).get("files") or []:
        p = e["path"]
        for old, new in roots:
            if p == old or p.startswith(old + "/"):
                p = new + p[len(old):]
                break
        files.append({**e, "path": p})
    if not files:
        return meta
    return {**meta, "deps": {**meta["deps"], "files": files}}
