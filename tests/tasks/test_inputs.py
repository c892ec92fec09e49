import numpy as np
import pytest

from tasks.errors import ConfigError
from tasks.inputs import generated_feeds, load_feeds
from tasks.models import TensorInfo
from tasks.samples import render_text_image

X = [TensorInfo("x", "float32", ["n", 3, "h", "w"])]
PROFILES = [{"x": {"min": [1, 3, 32, 32], "opt": [1, 3, 64, 64], "max": [2, 3, 128, 128]}}]
RECIPE = {"source": "synthetic:text", "input": "x", "channel_order": "BGR", "scale": 1 / 255,
          "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "layout": "NCHW"}


def test_a_folder_of_images_feeds_the_model_through_the_recipe(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(render_text_image(100, 150, rng)).save(tmp_path / f"page{i}.png")
    feeds = generated_feeds(X, PROFILES, 1, 0, recipe={**RECIPE, "source": str(tmp_path)})
    assert [f["x"].shape for f in feeds[:3]] == [(1, 3, 32, 32), (1, 3, 64, 64), (2, 3, 128, 128)]
    assert all(f["x"].dtype == np.float32 and -1.0 <= f["x"].min() and f["x"].max() <= 1.0 for f in feeds)
    assert feeds[1]["x"].std() > 0.05  # real content, not a constant


def test_synthetic_text_pages_have_text():
    img = render_text_image(256, 256, np.random.default_rng(1))
    assert img.shape == (256, 256, 3) and (img < 100).mean() > 0.005  # dark glyph pixels on a light page


def test_stacked_samples_in_one_npz_are_split_and_capped(tmp_path):
    np.savez(tmp_path / "cal.npz", x=np.zeros((5, 1, 3, 32, 48), np.float32))
    feeds = load_feeds(str(tmp_path / "cal.npz"), X, PROFILES, "calibration.data", limit=3)
    assert len(feeds) == 3 and feeds[0]["x"].shape == (1, 3, 32, 48)


def test_empty_folder_and_inf_values_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no .npz"):
        load_feeds(str(tmp_path / "empty"), X, PROFILES, "calibration.data")
    np.savez(tmp_path / "inf.npz", x=np.full((1, 3, 32, 32), np.inf, np.float32))
    with pytest.raises(ConfigError, match="NaN or Inf"):
        load_feeds(str(tmp_path / "inf.npz"), X, PROFILES, "calibration.data")
