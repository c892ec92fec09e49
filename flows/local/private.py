"""Folders and files that only this user can reach: where the warm build process's socket, log and pid file live
(runtime_dir), and where the local Prefect API's secret is kept (secret_dir, secret).

A folder is private when `lstat` says it is a folder (not a link), owned by this user, with no group or other bits,
and its parent cannot be swapped under it by another user (owned by this user or root, and not writable by others
unless sticky). It is checked before every use: a folder another user made first (a squatter who could plant a
listener, or links at the names written here) is refused, never repaired. Files are opened without following links.
File modes follow one policy: what trtforge keeps for itself (secrets, records, logs, leases, locks, sockets) is
0600 in a 0700 folder; what it makes for the user (results, reports, `*_out` files) follows the user's umask
(result_mode). Standard library and tasks.common.errors only.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import stat
import sys
from pathlib import Path


from tasks.common.errors import ConfigError


class NotPrivate(ConfigError):
    """A folder or file that another user could read or change: bad input (exit 2), its message one line naming it and
    why, with the fix."""

    def __init__(self, message: str, *, fix: str | None = None):
        super().__init__(message, fix=fix or "remove it (as its owner, or root), or make it yours with mode 0700 "
                                              "(chmod 700 FOLDER); or point XDG_CACHE_HOME / XDG_RUNTIME_DIR / "
                                              "PREFECT_HOME at a folder of yours with mode 0700")

    def __reduce__(self):  # (a sweep's worker sends it back pickled)
        return type(self), (self.message,), {"fix": self.fix, "stage": self.stage, "file": self.file}


def cache_base() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()


def runtime_dir() -> Path:
    """Where sockets and pid files live: $XDG_RUNTIME_DIR/trtforge, else ~/.cache/trtforge/run (not checked here)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "trtforge" if xdg else cache_base() / "trtforge" / "run"


def secret_dir() -> Path:
    """Where secrets shared by this user's builds live (outlives a login, unlike $XDG_RUNTIME_DIR): not checked."""
    return cache_base() / "trtforge" / "private"


def problem(path: Path) -> str | None:
    """Why `path` is not a private folder of this user (None: it is)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}, not 0700"
    try:
        parent = os.stat(path.parent)
    except OSError as e:
        return f"has a parent that cannot be read ({e.strerror})"
    if parent.st_uid not in (0, os.geteuid()):
        return f"is in {path.parent}, which belongs to uid {parent.st_uid}"
    if parent.st_mode & 0o022 and not parent.st_mode & stat.S_ISVTX:
        return f"is in {path.parent}, which other users can write to"
    return None


def writable_by_others(path: Path) -> str | None:
    """Why another user could change `path` (a file or folder trtforge only reads, e.g. a template), or could swap
    it through its folder; None when nobody but this user (or root) can."""
    for p, what in ((path, str(path)), (path.parent, f"its folder {path.parent}")):
        try:
            st = os.lstat(p)
        except OSError as e:
            return f"{what} cannot be read ({e.strerror})"
        if p is path and stat.S_ISLNK(st.st_mode):
            return f"{what} is a symbolic link"
        if st.st_uid not in (0, os.geteuid()):
            return f"{what} belongs to uid {st.st_uid}"
        if st.st_mode & 0o022 and not (p is not path and st.st_mode & stat.S_ISVTX):
            return f"{what} can be written by other users"
    return None


def ensure(path: Path, what: str | None = None, chosen_by: str | None = None) -> Path:
    """`path` as a private folder of this user, made (mode 0700) when missing; NotPrivate (exit 2) naming it, why and
    the fix when it is not. With `what` (who keeps its state there) the message says so and why it matters: nothing is
    written there, and nothing read from it trusted. ``chosen_by`` names the setting that chose the folder, for the fix
    (default: the variables that choose the runtime and cache folders)."""
    name = f"{what} {path}" if what else str(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise NotPrivate(f"{name} cannot be made ({e.strerror})",
                         fix=f"make {path} yourself with mode 0700, or point it elsewhere") from None
    why = problem(path)
    if why:
        risk = ": other users could plant links or records there, or read it" if what else ""
        raise NotPrivate(f"{name} {why}{risk}", fix=fix_for(path, why, chosen_by))
    return path


def fix_for(path: Path, why: str, chosen_by: str | None = None) -> str:
    """How to make `path` private, given why it is not (problem()); ``chosen_by`` names the setting that chose it."""
    if why.startswith("has mode"):
        return f"chmod 700 {path}" + (f", or point {chosen_by} at a folder of yours with mode 0700" if chosen_by else "")
    chooser = chosen_by or "the variable that chose it (XDG_CACHE_HOME, XDG_RUNTIME_DIR, PREFECT_HOME)"
    return f"remove {path} (as its owner, or root) and run again, or point {chooser} at a folder of yours with mode 0700"


def require(path: Path, what: str) -> Path:
    """`path` as a private folder of this user for `what`, which keeps its state there (ensure with `what`)."""
    return ensure(path, what)


def warn(e: NotPrivate, what: str) -> None:
    """One line on stderr: the folder refused, why, and what happens instead."""
    print(f"trtforge: warning: {e.message}: {what}; fix: {e.fix}", file=sys.stderr, flush=True)


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def result_mode(executable: bool = False) -> int:
    """The mode of a file trtforge makes for the user (a result, a report): 0666 (0777 for an executable) less the
    user's umask."""
    return (0o777 if executable else 0o666) & ~umask()


def for_user(path: Path) -> None:
    """Give the files of a result trtforge made for the user (`path`: a file, or a folder and everything in it) the
    user's umask (result_mode; executables keep their x bits): some writers go through a private temporary file
    (tasks/common/util.py write_json: mkstemp, 0600) and would leave one file of a result 0600 and the next 0644. Links are
    not followed."""
    files = [path] if not path.is_dir() or path.is_symlink() else [f for f in path.rglob("*")]
    for f in files:
        try:
            st = os.lstat(f)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            want = result_mode(executable=bool(st.st_mode & 0o111))
            if stat.S_IMODE(st.st_mode) != want:
                os.chmod(f, want)


def die_with_parent(parent: int, sig: int | None = None) -> None:
    """Linux, in a child between fork and exec (preexec_fn): it gets `sig` (default SIGTERM) when the thread that
    started it dies, however it dies (even by SIGKILL), and exits now when `parent` died before this line."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig or signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)


def open_private(path: Path, flags: int) -> int:
    """os.open without following a link at `path` (O_NOFOLLOW), mode 0600 when created, close-on-exec."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def read_private(path: Path) -> str:
    """The text of a file in a private folder, never through a link ('' when missing or unreadable)."""
    try:
        fd = open_private(path, os.O_RDONLY)
    except OSError:
        return ""
    with os.fdopen(fd) as f:
        return f.read()


def write_private(path: Path, text: str) -> None:
    """Write a file in a private folder as one rename: a link planted at its name is replaced, never followed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # (a link planted at the temporary name goes, its target untouched)
    with open(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as f:
        f.write(text)
    os.replace(tmp, path)


def secret(name: str) -> str:
    """A random secret kept in `secret_dir()/name` (0600), made on first use and shared by this user's processes;
    NotPrivate when that folder or file is not private."""
    d = ensure(secret_dir())
    path = d / name
    for _ in range(2):
        try:
            fd = open_private(path, os.O_RDONLY)
        except FileNotFoundError:
            tmp = d / f".{name}.{os.getpid()}"
            try:
                with open(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as f:
                    f.write(secrets.token_urlsafe(32))
                os.link(tmp, path)  # never over one another process made first: every process gets the same secret
            except FileExistsError:
                pass
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            continue
        except OSError as e:
            raise NotPrivate(f"{path} cannot be read without following a link ({e.strerror})") from None
        with os.fdopen(fd) as f:
            st = os.fstat(f.fileno())
            if st.st_uid != os.geteuid() or st.st_mode & 0o077 or not stat.S_ISREG(st.st_mode):
                raise NotPrivate(f"{path} is not a file of this user with mode 0600")
            value = f.read().strip()
        if value:
            return value
        raise NotPrivate(f"{path} is empty")
    raise NotPrivate(f"{path} could not be made")
