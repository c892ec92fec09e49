import numpy as np
import pytest

from tasks.errors import ConfigError
from tasks.models import TensorInfo
from tasks.profiles import check_profiles, shapes_in_profile

X = [TensorInfo("x", "float32", ["n", 3, "h", "w"])]


def prof(mn, opt, mx):
    return [{"x": {"min": mn, "opt": opt, "max": mx}}]


def test_valid_profile_passes_and_static_inputs_are_filled_in():
    ins = X + [TensorInfo("scale", "float32", [1, 2])]
    full = check_profiles(prof([1, 3, 32, 32], [1, 3, 64, 64], [2, 3, 128, 128]), ins)
    assert full[0]["scale"] == {"min": [1, 2], "opt": [1, 2], "max": [1, 2]}


@pytest.mark.parametrize("profiles, words", [
    (prof([1, 3, 64, 64], [1, 3, 32, 32], [1, 3, 128, 128]), "min <= opt <= max"),
    (prof([1, 3, 32, 32], [1, 3, 256, 256], [1, 3, 128, 128]), "min <= opt <= max"),
    (prof([1, 3, 32], [1, 3, 32], [1, 3, 32]), "rank 3"),
    (prof([1, 4, 32, 32], [1, 4, 32, 32], [1, 4, 32, 32]), "fixed to 3"),
    ([{"xx": {"min": [1], "opt": [1], "max": [1]}}], "did you mean 'x'"),
    ([], "dynamic shape"),
])
def test_bad_profiles_are_refused_with_the_fix(profiles, words):
    with pytest.raises(ConfigError) as e:
        check_profiles(profiles, X)
    assert words in str(e.value)
    assert "fix:" in str(e.value)


def test_shapes_cover_min_opt_max_and_respect_multiples():
    p = check_profiles(prof([1, 3, 32, 32], [1, 3, 640, 640], [4, 3, 1280, 1280]), X)[0]
    shapes = shapes_in_profile(p, 20, np.random.default_rng(0), {"x": X[0].shape}, {"x": [1, 1, 32, 32]})
    assert shapes[0]["x"] == [1, 3, 32, 32] and shapes[1]["x"] == [1, 3, 640, 640] and shapes[2]["x"] == [4, 3, 1280, 1280]
    for s in shapes:
        n, c, h, w = s["x"]
        assert 1 <= n <= 4 and 32 <= h <= 1280 and h % 32 == 0 and w % 32 == 0
    assert len({tuple(s["x"]) for s in shapes}) > 5  # really random in between
