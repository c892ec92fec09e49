"""Accuracy figures of quantized graphs are the same on any x86-64 CPU: Q/DQ and integer ops are computed as written
(tasks/onnxrt/exact.py, tasks/onnxrt/ort.py ``exact``), never by ONNX Runtime's integer kernels, which it picks by instruction set
(an AVX2 host without VNNI saturates u8 x s8 products at 16 bits; VNNI and SSE4 accumulate exactly).

The cross-CPU test runs the same scoring under QEMU's user-mode emulation of an AVX2-only CPU (Haswell: no AVX-512, no
VNNI) and of an SSE4-only CPU (Nehalem), whatever CPU the host has."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tasks.accuracy.metrics import pooled_cosine
from tasks.onnxrt.ort import ort_run, ort_session
from tests.tasks.prequant.test_rewrite import quantized_models  # noqa: F401  (session fixture)

# CPU kernels of integer arithmetic (ONNX Runtime's fused or QOperator ops): none may run for an accuracy figure
INTEGER_KERNELS = {"QLinearConv", "QLinearMatMul", "QGemm", "MatMulInteger", "ConvInteger", "NhwcQLinearConv",
                   "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QLinearAdd", "QLinearMul", "QLinearSigmoid",
                   "QLinearGlobalAveragePool", "QLinearAveragePool", "QLinearConcat", "QLinearLeakyRelu"}
MODELS = ("static_u8", "static_s8", "static_u8w", "qoperator", "dynamic")
CPUS = ("Haswell-noTSX", "Nehalem-v1")  # AVX2 without AVX-512/VNNI; SSE4.2 only


def _feeds() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [{"x": rng.standard_normal((2, 3, 16, 16)).astype(np.float32)} for _ in range(3)]


def scores(folder: Path) -> dict[str, dict[str, float]]:
    """Per quantized model in ``folder``: its cosine to the fp32 model computed as written (``exact``, what every
    figure uses) and by ONNX Runtime's own integer kernels (``kernels``: CPU-dependent, shown for contrast)."""
    feeds = _feeds()
    ref = ort_session(folder / "f32.onnx")
    refs = [ort_run(ref, f) for f in feeds]
    out = {}
    for name in MODELS:
        row = {}
        for label, exact in (("exact", True), ("kernels", False)):
            s = ort_session(folder / f"{name}.onnx", exact=exact)
            row[label] = pooled_cosine([ort_run(s, f) for f in feeds], refs)
        out[name] = row
    return out


def _executed_ops(model: Path, exact: bool) -> set[str]:
    import onnxruntime as ort

    from tasks.onnxrt.exact import exact_integer_ops_of

    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(model.with_suffix(""))
    if exact:  # as ort_session(exact=True) makes it
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    s = ort.InferenceSession(exact_integer_ops_of(model)[0] if exact else str(model), so,
                             providers=["CPUExecutionProvider"])
    s.run(None, _feeds()[0])
    trace = Path(s.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink()
    return {e["args"]["op_name"] for e in events if e.get("cat") == "Node" and "op_name" in e.get("args", {})}


def test_quantized_graphs_never_run_integer_kernels(quantized_models):  # noqa: F811
    for name in MODELS:
        assert not _executed_ops(quantized_models[name], exact=True) & INTEGER_KERNELS, name
    # the check sees them where ONNX Runtime is left to choose: its fusion of Q/DQ, and the QOperator format's own ops
    assert "QLinearConv" in _executed_ops(quantized_models["static_u8"], exact=False)
    assert "QLinearConv" in _executed_ops(quantized_models["qoperator"], exact=False)


def test_two_kernel_paths_give_the_same_cosine(quantized_models):  # noqa: F811
    """ONNX Runtime's full optimisation (blocked NCHWc float convolutions) and none (the graph node by node) compute
    the same exact figure to 1e-6."""
    feeds = _feeds()
    folder = quantized_models["static_u8"].parent
    refs = [ort_run(ort_session(folder / "f32.onnx"), f) for f in feeds]
    for name in MODELS:
        got = {opt: pooled_cosine([ort_run(s, f) for f in feeds], refs)
               for opt in ("all", "none") for s in [ort_session(quantized_models[name], optimization=opt)]}
        assert abs(got["all"] - got["none"]) < 1e-6 and 0.99 < got["all"] < 1.0, (name, got)


def written_score(folder: Path) -> float:
    """The pooled cosine of the int8 graph the calibrate stage wrote (``written_int8.onnx``: every layer int8, the rest
    fp16) to its fp32 model, emulated as validate emulates it (``precision_runner``: int8 layers on their codes)."""
    from tasks.onnxrt.emulate import precision_runner
    from tasks.onnxrt.ort import ort_runner

    feeds = _feeds()
    ref, run = ort_runner(folder / "written_f32.onnx"), precision_runner(folder / "written_int8.onnx")[0]
    return pooled_cosine([run(f) for f in feeds], [ref(f) for f in feeds])


def _written(folder: Path) -> Path:
    """A folder holding a calibrate-written int8 graph with an fp16 remainder and its fp32 model (``written_score``)."""
    from tasks.quantization.calibrate import qdq_from_onnx
    from tests.conftest import make_conv_model

    src = make_conv_model(folder / "written_f32.onnx", channels=32)
    rng = np.random.default_rng(11)
    cal = [{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(4)]
    qdq_from_onnx(src, cal, folder / "written_int8.onnx", method="minmax", workdir=folder / "work")
    return folder


@pytest.mark.slow
def test_the_same_figures_on_an_avx2_only_and_an_sse4_only_cpu(quantized_models, tmp_path):  # noqa: F811
    """The pre-quantized models (Q/DQ and QOperator, u8 and s8) and an int8 graph as the calibrate stage writes it (fp16
    remainder, int8 layers emulated on their codes) score the same under an AVX2-only and an SSE4-only CPU."""
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        pytest.skip("qemu-x86_64 is not installed (make qemu: Debian's qemu-user), so no other CPU can be emulated")
    folder = quantized_models["static_u8"].parent
    written = _written(tmp_path)
    here, here_written = scores(folder), written_score(written)
    there = {}
    root = Path(__file__).resolve().parents[3]
    for cpu in CPUS:
        p = subprocess.run([qemu, "-cpu", cpu, sys.executable, "-m", "tests.tasks.onnxrt.test_exact", str(folder),
                            str(written)], cwd=root, capture_output=True, text=True, timeout=900,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-2000:]
        there[cpu] = json.loads(p.stdout.strip().splitlines()[-1])
    for cpu, got in there.items():
        for name in MODELS:
            assert abs(got[name]["exact"] - here[name]["exact"]) < 1e-6, (cpu, name, got[name], here[name])
        assert abs(got["written"] - here_written) < 1e-6 and 0.99 < here_written < 1.0, (cpu, got["written"], here_written)
    # and those CPUs really run different integer kernels (else the agreement above would prove nothing)
    assert max(abs(there[CPUS[0]][n]["kernels"] - there[CPUS[1]][n]["kernels"]) for n in MODELS) > 1e-5, there


if __name__ == "__main__":  # the probe the cross-CPU test runs under QEMU: the scores as one JSON line
    print(json.dumps({**scores(Path(sys.argv[1])), "written": written_score(Path(sys.argv[2]))}))

