"""A SIGTERM that reaches a build mid-stage ends it by that signal, whatever code it arrives in.

Prefect's flow engine turns SIGTERM into an exception (TerminationSignal) raised wherever the main thread is, and code
that catches broadly can take it for something else: arriving while a native module was being imported it became
"ImportError: initialization failed", a failed stage and a published failed result (exit 1); caught inside a library
it was lost and the build ran on to publish its result. ``watch_termination`` (called in the flow, after Prefect's
engine set its handler) remembers the first SIGTERM and hands it on to Prefect's handler, which reports the crash;
then the process ends by the signal within TERM_GRACE seconds whatever catches the exception, and sooner where the
build checks ``end_if_terminated`` (a stage's failure, the result about to be published)."""
from __future__ import annotations

import ctypes
import os
import signal
import threading

TERM_GRACE = 5.0  # seconds Prefect's handling of a SIGTERM gets before the process ends by the signal itself
_received: list[int] = []


def watch_termination() -> None:
    """From the flow's main thread: wrap the SIGTERM handler in place (Prefect's) for the rest of the flow run (the
    engine restores its predecessor when the run ends). Elsewhere (a thread) nothing changes."""
    try:
        before = signal.getsignal(signal.SIGTERM)

        def on_term(signum, frame):
            if not _received:
                _received.append(signum)
                timer = threading.Timer(TERM_GRACE, _die_from_any_thread, (signum,))
                timer.daemon = True
                timer.start()
            if callable(before):
                before(signum, frame)
            else:
                _die_from_any_thread(signum)
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        pass


def end_if_terminated() -> None:
    """End the process by the SIGTERM it received, if it received one (before a failure or a result is recorded)."""
    if _received:
        _die_from_any_thread(_received[0])


def _die_from_any_thread(sig: int) -> None:
    """End this process by ``sig`` from any thread: the signal's action reset to the default in the C library (Python
    lets only the main thread set a handler), then the signal sent to this process."""
    from flows.local.daemon import die_by

    if threading.current_thread() is threading.main_thread():
        die_by(sig)
    try:
        ctypes.CDLL(None, use_errno=True).signal(sig, ctypes.c_void_p(0))  # SIG_DFL
        os.kill(os.getpid(), sig)
    finally:
        os._exit(128 + sig)
