"""How a signal ends a build: a SIGTERM or Ctrl-C mid-stage ends it by that signal, whatever code it arrives in; Ctrl-C
and SIGTERM end it with one line (``end_by``), in every phase of the CLI (``on_ctrl_c_while_starting``).

Prefect's flow engine turns SIGTERM into an exception (TerminationSignal) raised wherever the main thread is, and code
that catches broadly can take it for something else: arriving while a native module was being imported it became
"ImportError: initialization failed", a failed stage and a published failed result (exit 1); caught inside a library
it was lost and the build ran on to publish its result. ``watch_termination`` (called in the flow, after Prefect's
engine set its handler) remembers the first SIGTERM and hands it on to Prefect's handler, which reports the crash;
then the process ends by the signal within TERM_GRACE seconds whatever catches the exception, and sooner where the
build checks ``end_if_terminated`` (a stage's failure, the result about to be published)."""
from __future__ import annotations

import os
import signal
import sys
import threading

TERM_GRACE = 5.0  # seconds Prefect's handling of a SIGTERM gets before the process ends by the signal itself
INT_GRACE = 10.0  # seconds a Ctrl-C's KeyboardInterrupt gets to end the build before the process ends by SIGINT itself
_received: list[int] = []
_interrupted: list[int] = []  # a Ctrl-C reached the flow
_ending = threading.Event()  # end_by answers the signal: the grace timers stand down


def watch_termination() -> None:
    """From the flow's main thread: wrap the SIGTERM handler in place (Prefect's) for the rest of the flow run (the
    engine restores its predecessor when the run ends), and the SIGINT handler: a Ctrl-C still raises KeyboardInterrupt
    where the build is, and where code swallows it (a library that catches everything, an error it is turned into)
    the process ends by SIGINT within INT_GRACE all the same (a build that ran on after Ctrl-C for minutes, or published
    a failed result). A Ctrl-C the CLI was started ignoring stays ignored. Elsewhere (a thread) nothing changes."""
    try:
        before_int = signal.getsignal(signal.SIGINT)
        if callable(before_int) and not getattr(before_int, "watched", False):
            def on_int(signum, frame):
                if not _interrupted:
                    _interrupted.append(signum)
                    timer = threading.Timer(INT_GRACE, _interrupt_overdue)
                    timer.daemon = True
                    timer.start()
                before_int(signum, frame)
            on_int.watched = True
            signal.signal(signal.SIGINT, on_int)
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
    """End the process by the SIGTERM it received, if it received one, and raise KeyboardInterrupt for a Ctrl-C that
    code took for an error of its own (before a failure or a result is recorded)."""
    if _received:
        _die_from_any_thread(_received[0])
    if _interrupted:
        raise KeyboardInterrupt


def _interrupt_overdue() -> None:
    """A Ctrl-C's KeyboardInterrupt did not end the build within INT_GRACE (code swallowed it): end it by SIGINT."""
    if not _ending.is_set():
        print("trtforge: stopped by SIGINT", file=sys.stderr, flush=True)
        _die_from_any_thread(signal.SIGINT)


def _die_from_any_thread(sig: int) -> None:
    """End this process by ``sig`` from any thread: the signal's action reset to the default in the C library (Python
    lets only the main thread set a handler), then the signal sent to this process."""
    import ctypes

    if threading.current_thread() is threading.main_thread():
        die_by(sig)
    try:
        ctypes.CDLL(None, use_errno=True).signal(sig, ctypes.c_void_p(0))  # SIG_DFL
        os.kill(os.getpid(), sig)
    finally:
        os._exit(128 + sig)


def die_by(sig: int):
    """End this process by `sig`, as the build's process ended (the shell sees 128+sig)."""
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    try:
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    except (OSError, ValueError):
        pass
    os._exit(128 + sig)  # a signal that does not end a process (SIGCHLD, ...)


EXIT_HANDLERS_SECONDS = 20.0  # Ctrl-C's exit handlers (log flushes, temporary folders, Prefect's last events) at most


def end_by(sig: int) -> None:
    """One line on stderr, then the process ends by `sig` (as a process without a handler for it would); exit
    handlers run for Ctrl-C as the interpreter runs them for an uncaught KeyboardInterrupt, not for SIGTERM, but for
    at most EXIT_HANDLERS_SECONDS, and a second Ctrl-C meanwhile ends the process at once. From the main thread."""
    import atexit

    _ending.set()
    print(f"trtforge: stopped by {signal.Signals(sig).name}", file=sys.stderr)
    if sig == signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends the process at once
        watchdog = threading.Timer(EXIT_HANDLERS_SECONDS, _exit_handlers_overdue, (threading.main_thread().ident,))
        watchdog.daemon = True
        watchdog.start()
        atexit._run_exitfuncs()
        watchdog.cancel()
    die_by(sig)


def _exit_handlers_overdue(thread: int) -> None:
    """Ctrl-C's exit handlers still run after EXIT_HANDLERS_SECONDS: say where they wait, then end by SIGINT (its
    handler is the default by now: the process ends as a second Ctrl-C would end it)."""
    import traceback

    frame = sys._current_frames().get(thread)
    where = "; ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                      for f in traceback.extract_stack(frame)[-3:]) if frame is not None else "unknown"
    print(f"trtforge: the exit handlers did not end within {EXIT_HANDLERS_SECONDS:.0f} s (waiting at {where}); "
          "ended without them", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGINT)


def _ctrl_c_while_starting(signum, frame) -> None:
    end_by(signal.SIGINT)


def on_ctrl_c_while_starting() -> None:
    """Ctrl-C while the CLI imports and starts (before ``flows.cli.finish`` answers it): the same line and end as
    later, not the interpreter's traceback from inside an import. A CLI started ignoring Ctrl-C (a background job of
    a script) keeps ignoring it."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _ctrl_c_while_starting)


def ctrl_c_as_keyboard_interrupt() -> None:
    """From here on Ctrl-C raises KeyboardInterrupt where the build is (``flows.cli.finish`` answers it), unless the CLI
    was started ignoring it."""
    if signal.getsignal(signal.SIGINT) is _ctrl_c_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)
