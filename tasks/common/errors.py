"""One exception family. Every message says what is wrong, where, and how to fix it (Polygraphy's rule)."""
from __future__ import annotations

import re


class TrtforgeError(Exception):
    """Base class of every error trtforge reports to a user."""

    exit_code = 1

    def __init__(self, message: str, *, stage: str | None = None, file: str | None = None, fix: str | None = None):
        self.message = message
        self.stage = stage
        self.file = file
        self.fix = fix
        super().__init__(self.render())

    def render(self) -> str:
        """The cause first, then how to fix it, then where (a file path can be long): nothing is cut."""
        text = f"[{self.stage}] {self.message}" if self.stage else self.message
        if self.fix:
            text += f"\n  fix: {self.fix}"
        if self.file:
            text += f"\n  in: {self.file}"
        return text


class ConfigError(TrtforgeError):
    """Bad input found before any heavy work: a config key, a file, a value."""

    exit_code = 2


class StageError(TrtforgeError):
    """A stage ran and failed (a library error wrapped with the stage and the file)."""

    exit_code = 1


class SegmentBuildError(StageError):
    """TensorRT could not build one TensorRT segment's engine (``segment``: its index in the partition plan)."""

    def __init__(self, message: str, *, segment: int, **kw):
        self.segment = segment
        super().__init__(message, **kw)


class AccuracyError(StageError):
    """The result is outside the accuracy budget."""


class UnavailableError(TrtforgeError):
    """What the build needs does not exist on this host (a GPU of the target's architecture, a backend)."""

    exit_code = 3


# a host without a GPU is expected: the CUDA runtime's complaints about it are no part of any cause
NOISE = re.compile(r"cudaError|CUDA initialization failure|no CUDA-capable device|CUDA driver version is insufficient|"
                   r"cuInit|cudaGetDevice|checkMacros\.cpp::catchCudaError")
ORT_PREFIX = re.compile(r"^\[ONNXRuntimeError\]\s*:\s*\d+\s*:\s*\w+\s*:\s*")
# ONNX Runtime repeats the model's path before its reason ("Load model from /cache/.../m.onnx failed:Type Error: ...");
# the error names the file after the cause already
ORT_LOAD = re.compile(r"Load model from \S+ failed:\s*")
# ONNX Runtime's C++ source location and the signature of the function that threw, before the reason
# ("/onnxruntime_src/onnxruntime/core/graph/model.cc:256 onnxruntime::Model::Model(onnx::ModelProto&&, ...) Unsupported")
CPP_WHERE = re.compile(r"/\S+\.(?:cc|cpp|h|hpp):\d+\s+")


def cause(e: BaseException | str) -> str:
    """The words of a library error that say what went wrong: its lines without CUDA-without-a-GPU noise, ONNX
    Runtime's "[ONNXRuntimeError] : 1 : FAIL :" prefix, its "Load model from <path> failed:" and its C++ source
    location and function signature dropped, joined; never cut."""
    text = str(e).strip() or (type(e).__name__ if isinstance(e, BaseException) else "")
    lines = [_without_cpp_where(ORT_LOAD.sub("", ORT_PREFIX.sub("", ln.strip())))
             for ln in text.splitlines() if ln.strip() and not NOISE.search(ln)]
    lines = [ln for ln in lines if ln]
    return " ".join(lines) if len(lines) <= 3 else " ".join(lines[:3]) + f" (+{len(lines) - 3} lines)"


def _without_cpp_where(line: str) -> str:
    """``line`` without a C++ source location and the function signature after it ("f.cc:46 void ns::f(int, T&) ")."""
    m = CPP_WHERE.search(line)
    if not m:
        return line
    rest = line[m.end():]
    sig = re.match(r"[\w:<>,*&~ ]*?\(", rest)
    if sig is None or len(sig.group(0)) > 200:
        return (line[:m.start()] + rest).strip()
    depth = 0
    for i in range(sig.end() - 1, len(rest)):
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        if depth == 0:
            return (line[:m.start()] + rest[i + 1:]).strip()
    return (line[:m.start()] + rest).strip()
