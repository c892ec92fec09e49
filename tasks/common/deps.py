"""What a stage's output depends on beyond its config: the files it actually read and the libraries that shape it.

Observed, not listed by hand: while a stage runs (``recording``), Python's audit hook sees every file opened through
Python (``open``, ``io.open``, ``os.open``: onnx.load and its external-data files, torch.load of a checkpoint,
numpy.load, PIL) and the modules imported from outside the Python installation (a torch factory's own modules).
Files that native code opens itself (paddle2onnx's C++ reading ``.pdiparams`` in a child process) are added from the
paths the library was given (``Recorder.add``). Files under the Python installation (covered by library versions),
``/proc``/``/dev``/``/sys`` and the folders a stage writes or that hold other stages' content-addressed outputs are
left out.

A manifest entry is (path, size, mtime_ns, sha256). ``changed`` checks a manifest the way make and ccache's direct
mode do: size and mtime equal is unchanged (fast path, no read), otherwise the content hash decides.
"""
from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import threading
from importlib import metadata
from pathlib import Path
from typing import Iterable, Iterator

from tasks.common.util import sha256_file

_local = threading.local()
_installed = False
_lock = threading.Lock()
SYSTEM = ("/proc/", "/dev/", "/sys/")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _python_roots() -> tuple[str, ...]:
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    roots |= {p for k in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_path(k))}
    return tuple(sorted({str(Path(r).resolve()) + os.sep for r in roots if r}))


class Recorder:
    def __init__(self, exclude: Iterable[os.PathLike | str] = ()):
        self.python = _python_roots()
        self.exclude = tuple(str(Path(e).resolve()) + os.sep for e in exclude) + self.python + SYSTEM
        self.paths: set[str] = set()
        self.packages: set[str] = set()  # top-level packages first imported from the Python installation meanwhile

    def add(self, path: os.PathLike | str) -> None:
        """A file read by native code or a child process (the audit hook cannot see those)."""
        p = os.path.realpath(os.fspath(path))
        if p.endswith(".pyc") or p.startswith(self.exclude) or not os.path.isfile(p):
            return
        self.paths.add(p)

    def _opened(self, args: tuple) -> None:
        path, mode, flags = (tuple(args) + (None, None, None))[:3]
        if isinstance(path, int) or path is None:  # a file descriptor: its path was seen when it was opened
            return
        if isinstance(mode, str) and any(c in mode for c in "wax+"):
            return
        if mode is None and isinstance(flags, int) and flags & WRITE_FLAGS:
            return
        try:
            self.add(os.fsdecode(path))
        except (OSError, ValueError):
            pass

    def manifest(self) -> list[dict]:
        return manifest(sorted(self.paths))

    def libraries(self) -> dict[str, str]:
        """Versions of the distributions whose packages were first imported while recording (e.g. what a torch
        factory imports: transformers, a package that ships weights)."""
        if not self.packages:
            return {}
        owners = package_owners()
        return library_versions(sorted({d for p in self.packages for d in owners.get(p, ())}))

    def record(self) -> dict:
        """What the stage depended on: {"files": manifest, "libraries": {distribution: version}}."""
        return {"files": self.manifest(), "libraries": self.libraries()}


_owners: tuple[tuple, dict] | None = None  # (the installation's stamp, {top-level package: [distribution]})


def package_owners() -> dict[str, list[str]]:
    """``importlib.metadata.packages_distributions()`` once per state of the installation: it reads every installed
    distribution's file list (0.3-0.5 s), and a stage that first imports a package (matplotlib for the sensitivity
    chart) would pay it each time. Installing or removing a distribution changes the mtime of its folder on
    ``sys.path``, which is the stamp."""
    global _owners
    stamp = tuple(_mtime(p) for p in sys.path)
    if _owners is None or _owners[0] != stamp:
        _owners = (stamp, metadata.packages_distributions())
    return _owners[1]


def _mtime(path: str) -> int | None:
    try:
        return os.stat(path or ".").st_mtime_ns
    except OSError:
        return None


def _hook(event: str, args: tuple) -> None:
    if event == "open":
        rec = getattr(_local, "recorder", None)
        if rec is not None:
            _local.recorder = None  # the hook's own file system calls are not the stage's
            try:
                rec._opened(args)
            finally:
                _local.recorder = rec


def note(*paths: os.PathLike | str) -> None:
    """Files read by native code (a C++ loader, a child process): added to this thread's recording, if any."""
    rec = getattr(_local, "recorder", None)
    if rec is not None:
        for p in paths:
            rec.add(p)


@contextlib.contextmanager
def recording(exclude: Iterable[os.PathLike | str] = ()) -> Iterator[Recorder]:
    """Record the files this thread reads, and the source files of modules imported from outside the Python
    installation, until the block ends. Audit hooks cannot be removed: one is installed once, gated per thread."""
    global _installed
    with _lock:
        if not _installed:
            sys.addaudithook(_hook)
            _installed = True
    rec = Recorder(exclude)
    before = set(sys.modules)
    outer = getattr(_local, "recorder", None)
    _local.recorder = rec
    try:
        yield rec
    finally:
        _local.recorder = outer
        for name in set(sys.modules) - before:
            f = getattr(sys.modules.get(name), "__file__", None)
            if not f:
                continue
            if os.path.realpath(f).startswith(rec.python):
                rec.packages.add(name.partition(".")[0])
            else:
                rec.add(f)
        if outer is not None:  # what a nested recording saw, the outer one read too
            outer.paths |= rec.paths
            outer.packages |= rec.packages


def manifest(paths: Iterable[str]) -> list[dict]:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append({"path": p, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(p)})
        except OSError:
            continue
    return out


def changed(record: dict | None) -> str | None:
    """What no longer holds of a dependency record (a file gone or changed, a library at another version), in words;
    None when everything holds (or there is no record)."""
    record = record or {}
    for name, was in (record.get("libraries") or {}).items():
        now = library_versions([name])[name]
        if now != was:
            return f"library {name} is {now}, was {was}"
    for e in record.get("files") or []:
        try:
            st = os.stat(e["path"])
        except OSError:
            return f"{e['path']} is gone"
        if st.st_size == e["size"] and st.st_mtime_ns == e["mtime_ns"]:
            continue
        if st.st_size != e["size"] or sha256_file(e["path"]) != e["sha256"]:
            return f"{e['path']} changed"
    return None


# The libraries whose versions shape each stage's output (their code computes it). Versions are read from the
# installed distributions; a library that is not installed reads "not installed".
STAGE_LIBRARIES = {
    "export": ("onnx", "numpy", "torch", "onnxscript", "paddle2onnx", "paddlepaddle", "protobuf"),
    "partition": ("onnx", "onnxruntime", "numpy"),
    "build": ("onnx", "onnxconverter-common", "numpy", "ml_dtypes"),
    "calibrate": ("onnx", "onnxruntime", "onnxconverter-common", "numpy", "ml_dtypes"),
    "validate": ("onnx", "onnxruntime", "numpy"),
    "benchmark": ("onnxruntime", "numpy"),
    "data": ("numpy", "Pillow"),  # images rendered or read for calibration/validation
}


def library_versions(names: Iterable[str]) -> dict[str, str]:
    out = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = "not installed"
    return out


def all_stage_libraries() -> dict[str, str]:
    return library_versions(sorted({n for names in STAGE_LIBRARIES.values() for n in names}))


def merge_deps(*records: dict) -> dict:
    """One dependency record of several (tasks.common.deps.Recorder.record): files by path, libraries by name."""
    files: dict[str, dict] = {}
    libs: dict[str, str] = {}
    for r in records:
        for e in (r or {}).get("files") or []:
            files.setdefault(e["path"], e)
        libs.update((r or {}).get("libraries") or {})
    return {"files": [files[k] for k in sorted(files)], "libraries": dict(sorted(libs.items()))}
