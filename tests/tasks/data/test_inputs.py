import numpy as np
import pytest

from tasks.common.errors import ConfigError
from tasks.data.inputs import generated_feeds, load_feeds
from tasks.graph.models import TensorInfo
from tasks.data.samples import render_text_image

X = [TensorInfo("x", "float32", ["n", 3, "h", "w"])]
PROFILES = [{"x": {"min": [1, 3, 32, 32], "opt": [1, 3, 64, 64], "max": [2, 3, 128, 128]}}]
RECIPE = {"source": "synthetic:text", "input": "x", "channel_order": "BGR", "scale": 1 / 255,
          "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "layout": "NCHW"}


def test_a_folder_of_images_feeds_the_model_through_the_recipe(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(4):  # min, opt and max (batch 2) take one image each, each image once
        Image.fromarray(render_text_image(100, 150, rng)).save(tmp_path / f"page{i}.png")
    feeds = generated_feeds(X, PROFILES, 1, 0, recipe={**RECIPE, "source": str(tmp_path)})
    assert [f["x"].shape for f in feeds[:3]] == [(1, 3, 32, 32), (1, 3, 64, 64), (2, 3, 128, 128)]
    assert all(f["x"].dtype == np.float32 and -1.0 <= f["x"].min() and f["x"].max() <= 1.0 for f in feeds)
    assert feeds[1]["x"].std() > 0.05  # real content, not a constant


def test_a_greyscale_recipe_feeds_one_channel_of_luma():
    """channel_order=GRAY: one channel, PIL's luma of the RGB image (ITU-R 601-2), scaled, with one mean and std."""
    import numpy as np
    from PIL import Image

    from tasks.data.samples import preprocess

    rgb = np.random.default_rng(0).integers(0, 256, (2, 8, 12, 3), dtype=np.uint8)
    recipe = {"channel_order": "GRAY", "scale": 1 / 255, "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5],
              "layout": "NCHW"}
    x = preprocess(list(rgb), recipe)
    assert x.shape == (2, 1, 8, 12)
    luma = np.stack([np.asarray(Image.fromarray(im).convert("L"), np.float32) for im in rgb])
    # PIL rounds its luma to whole levels: within half a level of it
    assert np.abs((x[:, 0] * 0.5 + 0.5) * 255 - luma).max() <= 0.5 + 1e-3


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


def test_samples_along_the_batch_axis_are_split_into_batches_that_fit_the_profile(tmp_path):
    from tasks.data.inputs import load_data

    det = [{"x": {"min": [1, 3, 32, 32], "opt": [8, 3, 64, 64], "max": [8, 3, 64, 64]}}]
    np.savez(tmp_path / "cal.npz", x=np.random.default_rng(0).random((16, 3, 32, 32), np.float32))
    feeds, rec = load_data(str(tmp_path / "cal.npz"), X, det, "calibration.data")
    assert [f["x"].shape for f in feeds] == [(8, 3, 32, 32)] * 2  # max batch 8: two batches of 8
    assert (rec.source, rec.feeds, rec.samples, rec.shapes) == ("file", 2, 16, [{"shape": {"x": [8, 3, 32, 32]}, "feeds": 2}])
    assert rec.sha256 and rec.files[0]["file"] == "cal.npz" and len(rec.files[0]["sha256"]) == 64
    assert "16 samples in 2 feeds" in rec.as_dict()["summary"]
    opt2 = [{"x": {**det[0]["x"], "opt": [2, 3, 64, 64]}}]
    assert len(load_feeds(str(tmp_path / "cal.npz"), X, opt2, "calibration.data")) == 8  # as the opt batch suggests
    assert len(load_feeds(str(tmp_path / "cal.npz"), X, opt2, "calibration.data", limit=5)) == 3  # >= 5 samples
    static = [TensorInfo("x", "float32", [1, 3, 40, 24])]
    np.savez(tmp_path / "static.npz", x=np.zeros((8, 3, 40, 24), np.float32))
    fixed = [{"x": {"min": [1, 3, 40, 24], "opt": [1, 3, 40, 24], "max": [1, 3, 40, 24]}}]
    feeds = load_feeds(str(tmp_path / "static.npz"), static, fixed, "validation.data")
    assert [f["x"].shape for f in feeds] == [(1, 3, 40, 24)] * 8  # a static batch-1 model: 8 samples


def test_two_inputs_split_together_and_mixed_forms_are_refused(tmp_path):
    ins = [TensorInfo("input_ids", "int64", ["batch", "seq"]), TensorInfo("attention_mask", "int64", ["batch", "seq"])]
    prof = [{n: {"min": [1, 1], "opt": [4, 16], "max": [8, 64]} for n in ("input_ids", "attention_mask")}]
    np.savez(tmp_path / "ok.npz", input_ids=np.ones((10, 16), np.int64), attention_mask=np.ones((10, 16), np.int64))
    feeds = load_feeds(str(tmp_path / "ok.npz"), ins, prof, "validation.data")
    assert [f["input_ids"].shape[0] for f in feeds] == [4, 4, 2]
    assert all(f["input_ids"].shape == f["attention_mask"].shape for f in feeds)
    np.savez(tmp_path / "mixed.npz", input_ids=np.ones((2, 10, 16), np.int64), attention_mask=np.ones((10, 16), np.int64))
    with pytest.raises(ConfigError, match="same form"):
        load_feeds(str(tmp_path / "mixed.npz"), ins, prof, "validation.data")
    np.savez(tmp_path / "counts.npz", input_ids=np.ones((10, 16), np.int64), attention_mask=np.ones((12, 16), np.int64))
    with pytest.raises(ConfigError, match="'input_ids' dim 0 is 10 but input 'attention_mask' dim 0 is 12"):
        load_feeds(str(tmp_path / "counts.npz"), ins, prof, "validation.data")  # the model ties their batch dims


GNN = [TensorInfo("x", "float32", ["num_nodes", 4]), TensorInfo("edge_index", "int64", [2, "num_edges"]),
       TensorInfo("edge_attr", "float32", ["num_edges", 3])]
GNN_PROFILE = [{"x": {"min": [1, 4], "opt": [16, 4], "max": [64, 4]},
                "edge_index": {"min": [2, 1], "opt": [2, 32], "max": [2, 128]},
                "edge_attr": {"min": [1, 3], "opt": [32, 3], "max": [128, 3]}}]


def gnn_graph(rng: np.random.Generator, nodes: int, edges: int, stack: bool = False) -> dict:
    g = {"x": rng.standard_normal((nodes, 4)).astype(np.float32),
         "edge_index": rng.integers(0, nodes, (2, edges)).astype(np.int64),
         "edge_attr": rng.standard_normal((edges, 3)).astype(np.float32)}
    return {k: a[None] for k, a in g.items()} if stack else g


def test_a_graph_whose_inputs_do_not_share_axis_0_is_one_sample_in_either_form(tmp_path):
    """A GNN's feed (nodes [N, F], edges [2, E]): one sample, whether given at the inputs' rank or with a leading
    axis of 1 (a stack of one batch); nodes or edges are never counted as samples."""
    from tasks.data.inputs import load_data

    rng = np.random.default_rng(0)
    (tmp_path / "plain").mkdir()
    (tmp_path / "stacked").mkdir()
    for i, (n, e) in enumerate([(12, 30), (20, 44), (7, 16)]):
        np.savez(tmp_path / "plain" / f"g{i}.npz", **gnn_graph(rng, n, e))
        np.savez(tmp_path / "stacked" / f"g{i}.npz", **gnn_graph(rng, n, e, stack=True))
    for form in ("plain", "stacked"):
        feeds, rec = load_data(str(tmp_path / form), GNN, GNN_PROFILE, "calibration.data")
        assert [f["x"].shape[0] for f in feeds] == [12, 20, 7] and [f["edge_index"].shape for f in feeds][0] == (2, 30)
        assert (rec.feeds, rec.samples) == (3, 3), form
    np.savez(tmp_path / "wide.npz", **gnn_graph(rng, 80, 30))  # 80 nodes: outside the profile, named in the error
    with pytest.raises(ConfigError, match="outside every profile"):
        load_data(str(tmp_path / "wide.npz"), GNN, GNN_PROFILE, "calibration.data")


def test_data_whose_tied_dims_disagree_is_refused(tmp_path):
    from tasks.data.inputs import load_data
    from tasks.data.profiles import ShapeRules, named_ties

    ins = [TensorInfo("input_ids", "int64", ["batch", "seq"]), TensorInfo("attention_mask", "int64", ["batch", "seq"])]
    prof = [{n: {"min": [1, 1], "opt": [4, 16], "max": [8, 64]} for n in ("input_ids", "attention_mask")}]
    np.savez(tmp_path / "bad.npz", input_ids=np.ones((4, 16), np.int64), attention_mask=np.ones((4, 12), np.int64))
    with pytest.raises(ConfigError, match="'input_ids' dim 1 is 16 but input 'attention_mask' dim 1 is 12"):
        load_data(str(tmp_path / "bad.npz"), ins, prof, "validation.data", rules=ShapeRules(named_ties(ins)))


def test_heldout_shapes_span_the_profile_keep_the_opt_and_max_batch_and_draw_a_static_shape_as_many_samples():
    from tasks.data.inputs import heldout_shapes

    prof = {"x": {"min": [1, 3, 48, 64], "opt": [8, 3, 48, 320], "max": [16, 3, 48, 640]}}
    shapes = [s["x"]["opt"] for s in heldout_shapes(prof, 3, np.random.default_rng(0))]  # fixed shapes
    assert shapes[:3] == [[1, 3, 48, 64], [8, 3, 48, 320], [16, 3, 48, 640]]  # min, opt and max at their batch
    assert len(shapes) >= 4 and all(s[0] == 1 for s in shapes[3:]), shapes  # the rest: single samples
    static = {"x": {"min": [1, 3, 64, 64], "opt": [1, 3, 64, 64], "max": [1, 3, 64, 64]}}
    assert len(heldout_shapes(static, 3, np.random.default_rng(0))) == 6  # 3 + 3 samples of the one shape
