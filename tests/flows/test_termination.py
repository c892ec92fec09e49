"""A SIGTERM mid-build ends the build by that signal even where code catches the exception Prefect's handler turns it
into (flows/local/termination.py)."""
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(body: str) -> tuple[subprocess.CompletedProcess, float]:
    """``body`` in a process with the flow's watch in place (Ctrl-C's grace shortened to 1 s), answering Ctrl-C as a
    terminal's job does whatever this suite inherited."""
    code = textwrap.dedent("""
        import os, signal, sys, time
        class TerminationSignal(BaseException):  # what Prefect's flow engine raises for SIGTERM
            pass
        def prefect_handler(signum, frame):
            raise TerminationSignal()
        signal.signal(signal.SIGTERM, prefect_handler)
        import flows.local.termination as termination
        from flows.local.termination import end_if_terminated, watch_termination
        termination.INT_GRACE = 1.0
        watch_termination()
    """) + textwrap.dedent(body)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler))
    return r, time.monotonic() - t0


def _swallowing(sig: str) -> str:
    """A library loop that catches everything (as a native import turned SIGTERM into an ImportError), ``sig`` sent
    to the process in its first round."""
    return f"""
        for i in range(600):
            try:
                if i == 0:
                    os.kill(os.getpid(), signal.{sig})
                time.sleep(0.1)
            except BaseException:
                pass
        print("ran on")
    """


def test_a_sigterm_swallowed_by_the_code_it_lands_in_still_ends_the_process_by_it():
    r, seconds = _run(_swallowing("SIGTERM"))
    assert r.returncode == -signal.SIGTERM, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "ran on" not in r.stdout and seconds < 30


def test_a_stage_that_took_the_sigterm_for_its_own_failure_publishes_nothing():
    r, _ = _run("""
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        except BaseException:
            pass  # recorded as the stage's failure
        end_if_terminated()  # before the result is published
        print("published")
    """)
    assert r.returncode == -signal.SIGTERM and "published" not in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])


def test_a_ctrl_c_swallowed_by_the_code_it_lands_in_still_ends_the_build_by_it():
    """The benchmark of a gate's Ctrl-C test ran on for minutes (or published a failed result) after Ctrl-C: a
    KeyboardInterrupt that library code catches still ends the build, by SIGINT, with the CLI's line."""
    r, seconds = _run(_swallowing("SIGINT"))
    assert r.returncode == -signal.SIGINT, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "ran on" not in r.stdout and r.stderr == "trtforge: stopped by SIGINT\n" and seconds < 30


def test_a_stage_that_took_the_ctrl_c_for_its_own_failure_publishes_nothing():
    r, _ = _run("""
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except BaseException:
            pass  # recorded as the stage's failure
        try:
            end_if_terminated()  # before the result is published: the Ctrl-C, raised again for the CLI to answer
        except KeyboardInterrupt:
            print("interrupted")
            sys.exit(0)
        print("published")
    """)
    assert (r.returncode, r.stdout) == (0, "interrupted\n"), (r.returncode, r.stdout, r.stderr[-2000:])
