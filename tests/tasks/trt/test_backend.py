"""The TensorRT backend answers Ctrl-C and SIGTERM during a build: TensorRT calls back into Python (its logger, its
progress monitor) and swallows an exception raised there, so a signal handled inside a callback was lost and the build
ran on. Real TensorRT-RTX builds of a model made here."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest


class Stop(BaseException):
    """What this test's SIGTERM handler raises (as Prefect's raises TerminationSignal, Python's SIGINT KeyboardInterrupt)."""


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    """Enough convolutions that building them takes over a second."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, t = [], [], "x"
    for i in range(300):
        inits.append(numpy_helper.from_array(rng.standard_normal((64, 64, 3, 3)).astype(np.float32) * 0.05, f"w{i}"))
        nodes.append(helper.make_node("Conv", [t, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]))
        t = f"c{i}"
    g = helper.make_graph(nodes, "deep", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 128, 128])],
                          [helper.make_tensor_value_info(t, TensorProto.FLOAT, None)], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    path = tmp_path_factory.mktemp("deep") / "deep.onnx"
    onnx.save(m, str(path))
    return path


PROFILE = [{"x": {"min": [1, 64, 128, 128], "opt": [1, 64, 128, 128], "max": [1, 64, 128, 128]}}]


def test_a_sigterm_during_a_build_cancels_it_and_reaches_its_handler(deep_model):
    from tasks.trt.backend import Backend

    b = Backend("tensorrt_rtx")
    t0 = time.monotonic()
    assert b.build_engine(str(deep_model), PROFILE, "8.6")  # builds when nothing interrupts it
    whole = time.monotonic() - t0

    def stop(*_):
        raise Stop()

    old = signal.signal(signal.SIGTERM, stop)
    timer = threading.Timer(min(0.3, whole / 4), lambda: os.kill(os.getpid(), signal.SIGTERM))
    try:
        t0 = time.monotonic()
        timer.start()
        with pytest.raises(Stop):
            b.build_engine(str(deep_model), PROFILE, "8.6")
        interrupted = time.monotonic() - t0
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, old)
    assert interrupted < whole, (interrupted, whole)  # cancelled at its next step, not built to the end


def test_signals_keep_their_handlers_and_none_is_left_pending():
    from tasks.common.native import deferred_signals, signal_pending

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    seen = []
    old = signal.signal(signal.SIGTERM, lambda *_: seen.append("handled"))
    try:
        with deferred_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            assert signal_pending() and not seen  # recorded, not handled, while the native call runs
        assert seen == ["handled"] and not signal_pending()  # delivered to its own handler afterwards, once
    finally:
        signal.signal(signal.SIGTERM, old)
    assert {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} == before
