"""The CLI's exit (flows/cli.py exit_now): the status it was given, everything said reaches its reader, atexit handlers
and non-daemon threads finish; only the interpreter's own teardown is skipped. Ctrl-C's exit (finish): the handlers
run, for a bounded time."""
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


CTRL_C = r"""
import atexit, sys, threading, time
from pathlib import Path
import flows.cli as cli
import flows.local.termination as termination
out = Path(sys.argv[1])
termination.EXIT_HANDLERS_SECONDS = 2.0
def stuck_on_the_server():
    threading.Event().wait()  # an exit handler that never ends (a drain that waits on a server which never answers)
if sys.argv[2] == "stuck":
    atexit.register(stuck_on_the_server)
atexit.register(lambda: out.write_text("atexit;"))  # registered last: runs first
def main():
    raise KeyboardInterrupt
cli.finish(main)
"""


def test_ctrl_c_runs_the_exit_handlers_but_never_waits_on_them_without_end(tmp_path):
    """Ctrl-C: the exit handlers run (log flushes, temporary folders); one that never ends holds the process for
    EXIT_HANDLERS_SECONDS at most, and the message names where it waits; either way the process ends by SIGINT."""
    import signal
    import time

    for case in ("fine", "stuck"):
        marks = tmp_path / case
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-c", CTRL_C, str(marks), case], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == -signal.SIGINT, (case, p.stderr)
        assert marks.read_text() == "atexit;"
        lines = p.stderr.strip().splitlines()
        assert lines[0] == "trtforge: stopped by SIGINT"
        if case == "fine":
            assert len(lines) == 1 and time.monotonic() - t0 < 30
        else:
            assert len(lines) == 2 and "did not end within 2 s" in lines[1] and "stuck_on_the_server" in lines[1], lines
            assert time.monotonic() - t0 >= 2.0


MID_IMPORT = r"""
import os, runpy, signal, sys
at = sys.argv[1]
class CtrlCAt:  # Ctrl-C as the CLI starts importing this module
    def find_spec(self, name, path=None, target=None):
        if name == at:
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, CtrlCAt())
sys.argv = ["flows.build", "--cfg", "model=ppocr_cls", "precision=fp32"]
runpy.run_module("flows.build", run_name="__main__", alter_sys=True)  # as `python -m flows.build`
"""


def test_ctrl_c_while_the_cli_imports_says_the_same_line_not_a_traceback():
    """Ctrl-C while the CLI still imports (a real SIGINT, sent as each module's import starts): one line and the end
    by SIGINT, as mid-build, never the interpreter's traceback from inside an import."""
    import signal

    def answers_ctrl_c() -> None:  # as a terminal's job does, whatever this suite inherited (`make test &`: ignored)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    for module in ("uuid", "omegaconf", "flows.config", "tasks.report"):
        p = subprocess.run([sys.executable, "-c", MID_IMPORT, module], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, preexec_fn=answers_ctrl_c)
        assert (p.returncode, p.stderr) == (-signal.SIGINT, "trtforge: stopped by SIGINT\n"), (module, p.stderr)


def _cfg(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.build", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_cfg_prints_the_config_with_the_overrides_after_it(tmp_path):
    """`--cfg model=ppocr_cls` (the README's spelling): the override after the flag is applied, not taken as its value."""
    import yaml

    p = _cfg("--cfg", "model=ppocr_cls", "precision=fp32", f"out_dir={tmp_path / 'out'}")
    assert p.returncode == 0, p.stderr
    cfg = yaml.safe_load(p.stdout)
    assert cfg["model"]["name"] == "ppocr_cls"
    assert cfg["model"]["source"] == "pkg://rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx"
    assert cfg["precision"]["name"] == "fp32"
    assert not (tmp_path / "out").exists()  # printed, not built


def test_cfg_with_a_user_config_dir_and_hydras_job_spelling(tmp_path):
    (tmp_path / "conf" / "model").mkdir(parents=True)
    mine = (ROOT / "conf/model/ppocr_cls.yaml").read_text().replace("name: ppocr_cls", "name: mine")
    (tmp_path / "conf/model/mine.yaml").write_text(mine)
    for flag in (["--cfg"], ["--cfg", "job"]):
        p = _cfg(*flag, "--config-dir", str(tmp_path / "conf"), "model=mine", f"out_dir={tmp_path / 'out'}")
        assert p.returncode == 0, p.stderr
        assert "\n  name: mine\n" in p.stdout, p.stdout
    assert not (tmp_path / "out").exists()
