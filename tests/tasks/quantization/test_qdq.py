"""Q/DQ graphs with fixed ranges (tasks/quantization/qdq.py)."""
import numpy as np
from onnx import numpy_helper

from tasks.quantization.qdq import Quantizer
from tasks.quantization.ranges import alternative_ranges, ranges_from_feeds


def _same_graph(a, b) -> None:
    assert [n.SerializeToString() for n in a.graph.node] == [n.SerializeToString() for n in b.graph.node]
    ia = {t.name: numpy_helper.to_array(t) for t in a.graph.initializer}
    ib = {t.name: numpy_helper.to_array(t) for t in b.graph.initializer}
    assert set(ia) == set(ib)
    for k in ia:
        assert ia[k].dtype == ib[k].dtype and np.array_equal(ia[k], ib[k]), k


def test_other_ranges_rescale_the_same_graph_as_quantizing_again(det_path, tmp_path):
    """A quantizer with other ranges (the percentile and max ranges the search tries per tensor) derives its graph from
    the first one's by rewriting the activation scales ORT's quantizer computes: the very graph quantizing again gives,
    and the scales do differ between the range sets."""
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.uniform(-2, 2, (1, 3, 96, 96)).astype(np.float32)} for _ in range(2)]
    ranges, _ = ranges_from_feeds(det_path, feeds, "entropy", tmp_path)
    q = Quantizer(det_path, ranges, "int8")
    full = q.qdq(q.layers)
    for method, other in alternative_ranges(ranges).items():
        derived = q.with_ranges(other)
        fresh = Quantizer(det_path, other, "int8")
        _same_graph(derived.qdq(derived.layers), fresh.qdq(fresh.layers))
        _same_graph(derived.qdq(derived.layers[:5]), fresh.qdq(fresh.layers[:5]))
        scales = {t.name: numpy_helper.to_array(t) for t in full.graph.initializer if t.name.endswith("_scale")}
        moved = [t.name for t in derived.qdq(derived.layers).graph.initializer
                 if t.name in scales and not np.array_equal(numpy_helper.to_array(t), scales[t.name])]
        assert len(moved) >= 10, (method, moved)
