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
