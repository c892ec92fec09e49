"""The CLI's exit (flows/cli.py exit_now): the status it was given, everything said reaches its reader, atexit handlers
and non-daemon threads finish; only the interpreter's own teardown is skipped."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import atexit, sys, threading, time
from pathlib import Path
from flows.cli import exit_now
out = Path(sys.argv[1])
atexit.register(lambda: out.write_text(out.read_text() + "atexit;"))
out.write_text("")
def slow():
    time.sleep(0.3)
    out.write_text(out.read_text() + "thread;")
threading.Thread(target=slow).start()
print("said", end="")  # no newline: still flushed
sys.stderr.write("warned")
exit_now(3)
"""


def test_exit_now_keeps_the_status_the_output_and_the_exit_handlers(tmp_path):
    marks = tmp_path / "marks"
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(marks)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 3
    assert p.stdout == "said" and p.stderr == "warned"
    assert marks.read_text() == "thread;atexit;"  # the thread joined first, then the handlers ran
