"""Empty, migrated Prefect and MLflow databases, made once per library version and copied where a new one is needed.

A new Prefect database costs its server about 6 s of migrations and block registration on first start (9 s instead of
3 s), a new MLflow store about 1 s of table creation: every first build on a machine, in a new PREFECT_HOME or with a
new tracking store paid them. `make setup` (and `python -m flows.local.templates`) makes each once, by the library's own
code (a real `prefect server start`; MLflow's SqlAlchemyStore), in `$XDG_CACHE_HOME/trtforge/templates` (default
~/.cache), named after the library's version: the schema a newer release wants is never served from an older template.
Without a template (another install path, a wiped cache) nothing changes: the library migrates the new database itself.
Standard library only.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def template_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "trtforge" / "templates"


def template(lib: str) -> Path | None:
    """Where the template for the installed `lib` ("prefect" or "mlflow") lives (None: the library is not installed)."""
    try:
        return template_dir() / f"{lib}-{version(lib)}.db"
    except PackageNotFoundError:
        return None


def seed(db: Path, lib: str) -> bool:
    """Copy the template of `lib` to `db` when `db` does not exist yet and a template does: True when copied.
    Never over an existing file (hard-linked into place from a private copy), whatever runs beside it."""
    from flows.local import private

    src = template(lib)
    if db.exists() or src is None or not src.is_file():
        return False
    if private.writable_by_others(src) or private.writable_by_others(src.parent):
        return False  # a template another user could have written is not copied into the user's database
    db.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{db.name}.", dir=db.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.link(tmp, db)
        return True
    except OSError:  # another process made it first, or the folder refuses links: the library makes its own
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _publish(made: Path, lib: str) -> Path:
    """Copy a freshly made database into the template folder as one consistent file (SQLite's backup: any WAL
    folded in), then rename it into place."""
    dst = template(lib)
    assert dst is not None
    dst.parent.mkdir(parents=True, exist_ok=True)
    from flows.local import private

    why = private.writable_by_others(dst.parent)
    if why:
        raise RuntimeError(f"not writing a template there: {why}")
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # (a link at the temporary name goes, its target untouched)
    with contextlib.closing(sqlite3.connect(made)) as src, contextlib.closing(sqlite3.connect(tmp)) as out:
        mode = src.execute("PRAGMA journal_mode").fetchone()[0]
        src.backup(out)
    with contextlib.closing(sqlite3.connect(tmp)) as out:  # the library's journal mode, kept in the file: Prefect's
        out.execute(f"PRAGMA journal_mode={mode}")        # WAL switched on by its first connections would lock the
    tmp.replace(dst)                                      # others out ("database is locked" on the first flow run)
    return dst


def make_prefect(timeout: float = 120.0) -> Path:
    """Start `prefect server start` on a new database in a scratch PREFECT_HOME (it migrates and registers its
    block types as on any first start), stop it, keep the database."""
    with tempfile.TemporaryDirectory(prefix="trtforge-template-") as d:
        import secrets

        from flows.local.net import healthy, reserve
        from flows.local.prefect_api import server_command

        sock = reserve()  # bound here, served by the server: never free in between
        port = sock.getsockname()[1]
        env = {k: v for k, v in os.environ.items()
               if k not in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PREFECT_API_DATABASE_CONNECTION_URL",
                            "PREFECT_SERVER_DATABASE_CONNECTION_URL")}
        # a secret for this one start: nobody else uses the scratch server while it migrates
        env.update(PREFECT_HOME=d, PREFECT_SERVER_ANALYTICS_ENABLED="false",
                   PREFECT_SERVER_API_AUTH_STRING=secrets.token_urlsafe(32))
        log = Path(d) / "server.log"
        with open(log, "wb") as out, sock:
            proc = subprocess.Popen(server_command(port, sock.fileno()), pass_fds=(sock.fileno(),),
                                    env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        try:
            t0 = time.monotonic()
            while not healthy(f"http://127.0.0.1:{port}/api", timeout=1.0):
                if proc.poll() is not None or time.monotonic() - t0 > timeout:
                    raise RuntimeError(f"prefect server start did not answer: {log.read_text()[-1500:]}")
                time.sleep(0.25)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return _publish(Path(d) / "prefect.db", "prefect")


def make_mlflow() -> Path:
    """MLflow's own store code on a new SQLite file (tables, migrations, default workspace); its default experiment
    is removed again: each store creates it on first use, with its own artifact location."""
    import logging

    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="trtforge-template-") as d:
        db = Path(d) / "mlflow.db"
        store = SqlAlchemyStore(f"sqlite:///{db}", str(Path(d) / "mlruns"))
        store._dispose_engine()
        with contextlib.closing(sqlite3.connect(db)) as con:
            con.execute("DELETE FROM experiment_tags WHERE experiment_id = 0")
            con.execute("DELETE FROM experiments WHERE experiment_id = 0")
            con.commit()
        return _publish(db, "mlflow")


def main(argv: list[str]) -> int:
    force = "--force" in argv
    for lib, make in (("prefect", make_prefect), ("mlflow", make_mlflow)):
        dst = template(lib)
        if dst is None:
            print(f"{lib}: not installed, no template")
            continue
        if dst.is_file() and not force:
            print(f"{lib}: template {dst} (exists)")
            continue
        t0 = time.perf_counter()
        make()
        print(f"{lib}: template {dst} made in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
