"""Keep native-library chatter out of the user's output.

TensorRT prints from C++ straight to file descriptors 1/2 ("cudaError 35" without a driver, parser
padding dumps, layer listings). We redirect the descriptors for the duration of a native call, keep what
was printed for the log, and give the caller a console bound to the real terminal for progress bars.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from typing import Iterator

from tasks.common.errors import NOISE as CUDA_NOISE

NOISE = re.compile(CUDA_NOISE.pattern + r"|Padding mode|Pre-padding|Post-padding|^Layer\(")


class Captured:
    def __init__(self) -> None:
        self.text = ""

    @property
    def meaningful(self) -> list[str]:
        return [line for line in self.text.splitlines() if line.strip() and not NOISE.search(line)]


@contextlib.contextmanager
def quiet_native(terminal_fd_holder: list | None = None) -> Iterator[Captured]:
    """Redirect fds 1 and 2 to a temp file. `terminal_fd_holder`, if given, receives a text stream to the real stdout."""
    captured = Captured()
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    term = None
    with tempfile.TemporaryFile(mode="w+b") as sink:
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            if terminal_fd_holder is not None:
                term = os.fdopen(os.dup(saved_err), "w", buffering=1)
                terminal_fd_holder.append(term)
            yield captured
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_out, 1)
            os.dup2(saved_err, 2)
            os.close(saved_out)
            os.close(saved_err)
            if term is not None:
                term.close()
            sink.seek(0)
            captured.text = sink.read().decode(errors="replace")


_DEFERRED: list[int] = []  # signals received while native code that calls back into Python runs (deferred_signals)


def signal_pending() -> bool:
    """Whether a Ctrl-C or SIGTERM arrived during deferred_signals and waits to be delivered: a TensorRT progress
    monitor returns False on it, which cancels the build at its next step."""
    return bool(_DEFERRED)


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """SIGINT and SIGTERM recorded, not handled, while native code that calls back into Python runs (TensorRT's
    parser and builder call the logger and the progress monitor): TensorRT catches an exception raised in a callback
    ("Exception caught in log()") and carries on, so a Ctrl-C or a SIGTERM whose handler raised there would be lost
    and the build would run on. Each signal received is delivered again, to the handler it had, once the native call
    returns. Signals that are ignored or end the process by default keep doing so; off the main thread (where no
    handler runs) nothing changes."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = len(_DEFERRED)
    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if callable(handler):
            old[sig] = signal.signal(sig, lambda s, _frame: _DEFERRED.append(s))
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        received = list(dict.fromkeys(_DEFERRED[before:]))
        del _DEFERRED[before:]
        for sig in received:
            signal.raise_signal(sig)  # its own handler runs now, outside the native call
