"""tasks.onnxrt.ort.ordered_runs: runs of one real ONNX Runtime session a few at a time, the results in order and equal
to one run at a time, nothing left running when the consumer stops."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tasks.common.errors import StageError
from tasks.onnxrt.ort import RunControl, ordered_runs, ort_run, ort_session


def _session():
    """MatMul -> Relu -> MatMul -> Softmax, on ONNX Runtime's threads."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((64, 256)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((256, 32)).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["z"]), helper.make_node("Softmax", ["z"], ["y"], axis=-1)]
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 32])], [w1, w2])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return ort_session(m.SerializeToString())


def _feeds(n: int):
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((512, 64)).astype(np.float32)} for _ in range(n)]


class _Watch:
    """Wraps a run: how many are inside at once, and how many started."""

    def __init__(self, run, pause: float = 0.02):
        self.run, self.pause, self.lock = run, pause, threading.Lock()
        self.inside = self.most = self.started = 0

    def __call__(self, item):
        with self.lock:
            self.inside += 1
            self.started += 1
            self.most = max(self.most, self.inside)
        try:
            time.sleep(self.pause)  # long enough that the next run starts before this one ends
            return self.run(item)
        finally:
            with self.lock:
                self.inside -= 1


def test_runs_go_two_at_a_time_in_order_with_the_numbers_of_one_at_a_time():
    session = _session()
    feeds = _feeds(7)
    alone = [ort_run(session, f)["y"] for f in feeds]
    watch = _Watch(lambda f: ort_run(session, f)["y"])
    together = list(ordered_runs(watch, feeds, 2))
    assert watch.most == 2 and watch.started == len(feeds)
    assert all(np.array_equal(a, b) for a, b in zip(alone, together))  # bit-equal: a run's own arithmetic
    assert not np.array_equal(together[0], together[1])  # in order: each feed's own output


def test_a_consumer_that_stops_leaves_no_run_going_and_keeps_what_ran_ahead():
    session = _session()
    feeds = _feeds(6)
    watch, kept = _Watch(lambda k: ort_run(session, feeds[k])["y"]), {}
    runs = ordered_runs(watch, range(len(feeds)), 2, keep=lambda k, out: kept.setdefault(k, out))
    first = next(runs)
    runs.close()
    assert watch.inside == 0 and watch.started == 2  # the one started ahead finished, nothing else began
    assert list(kept) == [1] and np.array_equal(kept[1], ort_run(session, feeds[1])["y"])
    assert np.array_equal(first, ort_run(session, feeds[0])["y"])


def test_a_consumer_that_stops_can_stop_the_runs_started_ahead():
    """With ``abandon`` (RunControl.stop) the run started ahead is told to stop: ONNX Runtime ends it with an error,
    nothing of it is kept, and the session runs on as before."""
    session = _session()
    feeds = _feeds(4)
    control, kept, stopped = RunControl(), {}, []

    def run(k):
        ro = control.options(k)
        try:
            time.sleep(0.0 if k == 0 else 0.5)  # the run ahead is still to start when the consumer stops
            return ort_run(session, feeds[k], options=ro)["y"]
        except StageError:
            stopped.append((k, ro.terminate))
            raise
        finally:
            control.done(k, ro)

    runs = ordered_runs(run, range(len(feeds)), 2, keep=lambda k, out: kept.setdefault(k, out), abandon=control.stop)
    first = next(runs)
    runs.close()
    assert kept == {} and stopped == [(1, True)]
    assert np.array_equal(first, ort_run(session, feeds[0])["y"])
    assert np.array_equal(ort_run(session, feeds[1], options=control.options(1))["y"], ort_run(session, feeds[1])["y"])


def test_a_failed_run_reaches_the_consumer_in_its_place():
    session = _session()
    feeds = _feeds(4)
    feeds[2] = {"x": np.zeros((3, 5), np.float32)}  # ONNX Runtime refuses the shape
    got = []
    with pytest.raises(StageError, match="ONNX Runtime failed"):
        for out in ordered_runs(lambda f: ort_run(session, f, stage="calibrate"), feeds, 2):
            got.append(out)
    assert len(got) == 2  # the runs before it came back, in order


def test_one_worker_runs_each_item_when_asked_for_it():
    started = []
    runs = ordered_runs(lambda k: started.append(k) or k, range(5), 1)
    assert next(runs) == 0 and started == [0]  # lazily: nothing ahead
    assert list(runs) == [1, 2, 3, 4]


def test_a_session_without_the_memory_pattern_gives_the_same_numbers():
    """ort_session(mem_pattern=False) (the accuracy search's switchable session: each value allocated as the run
    reaches it) computes exactly what the default session computes, runs two at a time included."""
    rng = np.random.default_rng(2)
    w1 = numpy_helper.from_array(rng.standard_normal((64, 256)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((256, 32)).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 32])], [w1, w2])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    planned = ort_session(m.SerializeToString(), threads=1)
    unplanned = ort_session(m.SerializeToString(), threads=1, mem_pattern=False)
    assert planned.get_session_options().enable_mem_pattern and not unplanned.get_session_options().enable_mem_pattern
    feeds = _feeds(4)
    want = [ort_run(planned, f)["y"] for f in feeds]
    got = list(ordered_runs(lambda f: ort_run(unplanned, f)["y"], feeds, 2))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert not np.array_equal(want[0], want[1])
