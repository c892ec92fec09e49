"""Command-line surface of `python -m flows.build`: Hydra overrides and sweeps, concise output."""
from __future__ import annotations

import argparse
import itertools
import os
import sys

from flows.context import origin_text



USAGE = """python -m flows.build [--config-dir DIR] [-m] [--cfg] key=value ...

  model=NAME target=sm_XX precision=fp32|fp16|int8|fp8      choose the config group options
  calibration.data=PATH validation.data=PATH               arrays (.npz/.npy or a folder), one per input
  accuracy.min_cosine=0.99  cache_dir=PATH  summary_out=PATH  out_dir=PATH
  accuracy.metric=cosine|allclose|top1|module:function     what gates validate, the int8 search and rebuilds
  -m target=sm_80,sm_86 precision=fp16,int8                sweep: one build per combination
  --config-dir DIR                                         add DIR (model/NAME.yaml, ...) to the config search path
  --cfg                                                    print the resolved config and exit
Exit status: 0 all stages ok, 1 a stage failed, 2 bad input, 3 needs a GPU/backend this host lacks. TRTFORGE_TRACEBACK=1 shows tracebacks."""


def parse_args(argv: list[str]):
    p = argparse.ArgumentParser(prog="python -m flows.build", usage=USAGE, add_help=False)
    p.add_argument("--config-dir", "-cd")
    p.add_argument("-m", "--multirun", action="store_true")
    # A flag, not an option with an optional value: with nargs="?" the override after it (`--cfg model=x`) became
    # its value and the default config was printed. Hydra's spelling `--cfg job` is accepted (job is what is printed).
    p.add_argument("--cfg", "-c", action="store_true")
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument("overrides", nargs="*")
    argv = [a for i, a in enumerate(argv) if not (a == "job" and i > 0 and argv[i - 1] in ("--cfg", "-c"))]
    args, unknown = p.parse_known_args(argv)
    if args.help:
        try:
            print(USAGE)
        except BrokenPipeError:  # `| head`
            pass
        return None
    if unknown:
        print(f"trtforge: error: unknown option {unknown[0]!r}\n  fix: see python -m flows.build --help", file=sys.stderr)
        sys.exit(2)
    return args


def expand_overrides(overrides: list[str], multirun: bool) -> list[list[str]]:
    """Hydra's override grammar; with -m, comma lists / range() / choice() expand into one build per combination."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as e:
        raise SystemExit(f"trtforge: error: cannot parse overrides: {str(e).splitlines()[0]}\n  fix: write key=value") from None
    if not multirun:
        if any(o.is_sweep_override() for o in parsed):
            bad = next(o for o in parsed if o.is_sweep_override())
            print(f"trtforge: error: {bad.input_line!r} is a sweep\n  fix: add -m to build every combination", file=sys.stderr)
            sys.exit(2)
        return [overrides]
    axes = []
    for o in parsed:
        key = o.get_key_element()
        if o.is_sweep_override():
            axes.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            axes.append([o.input_line])
    return [list(c) for c in itertools.product(*axes)]


def _console():
    from rich.console import Console

    return Console(stderr=False, highlight=False, soft_wrap=True)


def print_stage(name: str, entry: dict) -> None:
    mark = {"ok": "[green]✓[/]", "cached": "[cyan]✓[/]", "skipped": "[yellow]-[/]", "failed": "[red]✗[/]"}.get(entry["status"], "?")
    reason = f"  [dim]{entry['reason']}[/]" if entry.get("reason") and entry["status"] != "failed" else ""
    if entry.get("cached_from"):
        reason += f"  [dim]{origin_text(entry['cached_from'])}[/]"
    _console().print(f" {mark} {name:<9} {entry['status']:<7} {entry.get('seconds', 0):7.2f}s{reason}")
    for w in entry.get("warnings", []):
        _console().print(f"   warning: {w}", markup=False, style="yellow")


def print_summary(summary: dict, seconds: float) -> None:
    c = _console()
    ok = summary["status"] == "ok"
    head = f"{summary['model']} → {summary['target']} {summary['precision']}"
    c.print(f"[bold]{head}: {'[green]ok[/]' if ok else '[red]failed[/]'}[/] in {seconds:.1f}s")
    if not ok and summary.get("error"):
        c.print(f"  {summary['error'].splitlines()[0]}", markup=False, style="red")
        for line in summary["error"].splitlines()[1:]:
            c.print(f"  {line.strip()}", markup=False)
    for e in summary["engines"]:
        c.print(f"  engine   {summary['out_dir']}/{e['file']}  ({e['bytes'] / 1e6:.1f} MB, sha256 {e['sha256'][:16]}…)")
    m = summary["metrics"]
    acc = summary.get("accuracy") or {}
    if "cosine_min" in m and acc.get("metric") not in (None, "cosine"):  # the user's metric first, cosine beside it
        c.print(f"  accuracy {acc['metric']} {acc['score']:.6g} ({'passed' if acc['passed'] else 'FAILED'}: "
                f"{acc['rule']}), cosine_min {m['cosine_min']:.6f}, vs "
                f"{summary['stages']['validate'].get('reference', 'fp32')}, measured by {accuracy_source(summary)}",
                markup=False)
    elif "cosine_min" in m:
        c.print(f"  accuracy cosine_min {m['cosine_min']:.6f} vs {summary['stages']['validate'].get('reference', 'fp32')}, "
                f"measured by {accuracy_source(summary)}", markup=False)
    elif summary.get("verdict"):
        v = summary["stages"].get("validate", {})
        cached = f"; {origin_text(v['cached_from'])}" if v.get("cached_from") else ""
        c.print(f"  accuracy {summary['verdict']}{cached}", markup=False)
    if "flops_share" in m:
        from tasks.trt import describe

        c.print(f"  flops    {describe(m)} (estimated on the TensorRT network)", markup=False)
    if "peak_rss_mib" in m:  # this run's processes; an up-to-date answer shows the run that built it
        mem = summary.get("memory") or {}
        stage = max(((n, e["peak_rss_mib"]) for n, e in summary["stages"].items() if "peak_rss_mib" in e),
                    key=lambda x: x[1], default=None)
        c.print(f"  memory   peak {m['peak_rss_mib']:.0f} MiB resident" + (f" ({stage[0]} stage)" if stage else "") +
                (f", budget {mem['budget_mib']} MiB" if "budget_mib" in mem else ""), markup=False)
    if "reformat_layers" in m:
        from tasks.trt import describe_boundaries

        c.print(f"  reformat {describe_boundaries(m)}", markup=False)
    c.print(f"  summary  {summary['out_dir']}/summary.json")
    run = summary.get("mlflow") or {}
    if run:
        c.print(f"  mlflow   run {run['run_id']} in {run['tracking_uri']}")
        from flows.tracking import ui_link

        c.print(f"           make ui → {ui_link('http://127.0.0.1:5000', run['experiment_id'], run['run_id'])}")


def accuracy_source(summary: dict) -> str:
    """What the accuracy number measured, in words: ONNX Runtime's emulation of the precision, or the engine."""
    m, v = summary["metrics"], summary["stages"].get("validate", {})
    src = m.get("cosine_source", "")
    from tasks.onnxrt import SAME_ON_ANY_CPU

    exact = f" (quantized layers computed in float: {SAME_ON_ANY_CPU})" if SAME_ON_ANY_CPU in src else ""
    text = f"the engine on {src[len('engine on '):]}" if src.startswith("engine on ") else \
        f"ONNX Runtime emulation of {summary['precision']}{exact} on this host, not the engine"
    if v.get("cached_from"):
        text += f"; {origin_text(v['cached_from'])}"
    return text


def finish(main) -> None:
    """Run the CLI's `main()` and end the process as the interpreter would end it, the same whether the process is
    the CLI's own or a warm process's child: `sys.exit(n)` exits n; `SystemExit("message")` prints the message on
    stderr and exits 1; Ctrl-C (KeyboardInterrupt) and a SIGTERM that Prefect's flow engine turned into an exception
    say so in one line and end the process by that signal (the shell sees 128+n); anything else is an internal error
    (exit 1, traceback with TRTFORGE_TRACEBACK=1). Never returns."""
    import signal

    from flows.local.termination import end_by

    try:
        code = main()
    except SystemExit as e:
        code = e.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        end_by(signal.SIGINT)
    except BaseException as e:  # noqa: BLE001
        sig = getattr(e, "signal", None)
        if type(e).__name__ == "TerminationSignal" and isinstance(sig, int):  # prefect.exceptions (not imported here)
            end_by(sig)
        if os.environ.get("TRTFORGE_TRACEBACK"):
            import traceback

            traceback.print_exc()
        print(f"trtforge: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    exit_now(code)


def exit_now(code: int):
    """End the CLI with `code` once its work is done, without the interpreter's finalization (about a second of
    module teardown and native destructors after a build, measured with benchmarks/bench_build.py): threads that are
    not daemons are joined and atexit handlers run (log flushes, temporary folders, starting the warm process), then
    stdout and stderr are flushed and the process exits."""
    import atexit
    import threading

    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`): nothing left to say
            pass
    os._exit(code)
