"""Process-level primitives shared by the cache and the local Prefect server: flock-based locks (released by the
kernel when their holder dies) and whether a pid is alive. Standard library only."""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock (flock on `path`, never opened through a link): released by the kernel when the holder
    dies, even by SIGKILL."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def lock_dir() -> Path:
    """Where named locks live: a private folder of this user's (flows/local/private.py), checked before every use:
    the runtime folder's `locks/`, else `$TMPDIR/trtforge-locks-<uid>` when that one is not private (made first by
    someone else). NotPrivate when neither is."""
    import tempfile

    from flows.local import private

    try:
        return private.ensure(private.ensure(private.runtime_dir()) / "locks")
    except private.NotPrivate as first:
        try:
            return private.ensure(Path(tempfile.gettempdir()) / f"trtforge-locks-{os.geteuid()}")
        except private.NotPrivate:
            raise first from None


def named_lock(path: Path, what: str):
    """An exclusive lock named after `path` (a result folder, a tracking store), kept in this user's private lock
    folder: nothing is written into `out_dir` before a result is, and no other user can hold or plant it."""
    import hashlib

    digest = hashlib.sha256(str(path).encode()).hexdigest()[:24]
    return locked(lock_dir() / f"{path.name}.{what}.{digest}.lock")


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (on this host)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
