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
    """An exclusive lock (flock on `path`): released by the kernel when the holder dies, even by SIGKILL."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def named_lock(path: Path, what: str):
    """An exclusive lock named after `path` (a result folder, a tracking store), kept in the temp dir: nothing is
    written into `out_dir` before a result is."""
    import hashlib
    import tempfile

    digest = hashlib.sha256(str(path).encode()).hexdigest()[:24]
    return locked(Path(tempfile.gettempdir()) / "trtforge-locks" / f"{path.name}.{what}.{digest}.lock")


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (on this host)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
