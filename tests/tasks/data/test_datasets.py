"""The calibration / search / validation split (tasks/data/datasets.py): disjoint by sample, image folders by file."""
import numpy as np
import pytest

from tasks.data.datasets import split_data
from tasks.data.sets import UserData
from tasks.common.errors import ConfigError
from tasks.graph.models import TensorInfo
from tasks.data.profiles import ShapeRules

X = [TensorInfo("x", "float32", ["batch", 3, 8, 8])]
PROFILE = [{"x": {"min": [1, 3, 8, 8], "opt": [4, 3, 8, 8], "max": [8, 3, 8, 8]}}]
STATIC = [TensorInfo("x", "float32", [1, 3, 8, 8])]
STATIC_PROFILE = [{"x": {"min": [1, 3, 8, 8], "opt": [1, 3, 8, 8], "max": [1, 3, 8, 8]}}]


def user(n: int, key: str = "calibration.data", seed: int = 0, batch: int = 4) -> UserData:
    """n distinct samples (each sample's values start at its index: identifiable), in feeds of `batch`."""
    x = np.stack([np.full((3, 8, 8), i + seed * 1000, np.float32) for i in range(n)])
    feeds = [{"x": x[i:i + batch]} for i in range(0, n, batch)]
    return UserData(key, f"/data/{key}.npz", f"{seed:064d}", feeds, [{"file": f"{key}.npz", "sha256": "0" * 64}])


def ids(s) -> set[int]:
    return {int(v) for f in s.feeds for v in f["x"][:, 0, 0, 0]}


def split(**kw):
    args = dict(inputs=X, profiles=PROFILE, rules=ShapeRules(), calibrate=True, search=True, validate=True)
    return split_data(**{**args, **kw})


def test_calibration_data_alone_splits_three_ways_by_sample_never_by_feed():
    s = split(calibration_data=user(16))  # 16 samples in 4 feeds of 4: a feed-level split would hold out 1 feed
    cal, search, val = ids(s.calibration), ids(s.search), ids(s.validation)
    assert (len(cal), len(search), len(val)) == (8, 4, 4)
    assert not (cal & search) and not (cal & val) and not (search & val) and cal | search | val == set(range(16))
    assert all(f["x"].shape[0] <= 4 for f in s.validation.feeds)  # re-batched at the opt batch
    d = s.summary()
    assert {k: v["samples"] for k, v in d.items()} == {"calibration": 8, "search": 4, "validation": 4}
    assert "held out for validation" in d["validation"]["source"] and not s.notes


def test_too_little_data_says_so_and_validates_on_what_is_left():
    s = split(calibration_data=user(1, batch=1))
    assert ids(s.calibration) == {0} and s.search is None
    assert s.validation.kind == "random" and any("too few to hold any out for validation" in n for n in s.notes)
    assert any("judges on the calibration samples themselves" in n for n in s.notes)
    assert s.validation.thin and "random inputs" in s.validation.thin[0]


def test_two_samples_hold_one_out_for_validation_first():
    s = split(calibration_data=user(2, batch=1))
    assert len(ids(s.validation)) == 1 and len(ids(s.calibration)) == 1 and s.search is None


def test_validation_data_validates_and_calibration_data_gives_the_search_its_share():
    s = split(calibration_data=user(8), validation_data=user(5, "validation.data", seed=1))
    assert ids(s.validation) == {1000 + i for i in range(5)}
    assert len(ids(s.search)) == 2 and len(ids(s.calibration)) == 6 and not ids(s.search) & ids(s.calibration)


def test_the_same_samples_in_calibration_and_validation_data_are_refused():
    with pytest.raises(ConfigError, match="share 3 samples") as e:
        split(calibration_data=user(8), validation_data=user(3, "validation.data"))
    assert "validation.data" in e.value.fix


def test_an_fp16_build_is_validated_on_the_calibration_data_the_user_gave():
    s = split(calibrate=False, search=False, calibration_data=user(6))
    assert s.calibration is None and s.search is None and ids(s.validation) == set(range(6))
    assert "calibration data validates it" in s.validation.notes[0]


def test_calibration_samples_caps_the_calibration_set_only():
    s = split(calibration_data=user(40), calibration_samples=8)
    assert len(ids(s.calibration)) == 8 and len(ids(s.validation)) == 10 and len(ids(s.search)) == 8


def test_an_image_folder_splits_by_file(tmp_path):
    from PIL import Image

    for i in range(8):
        Image.fromarray(np.full((8, 8, 3), i * 30, np.uint8)).save(tmp_path / f"img{i}.png")
    recipe = {"source": str(tmp_path), "input": "x", "height": 8, "width": 8, "channel_order": "RGB", "scale": 1.0,
              "mean": [0, 0, 0], "std": [1, 1, 1], "layout": "NCHW"}
    s = split(recipe=recipe, calibration_samples=4)
    files = {k: {f["file"] for f in getattr(s, k).files} for k in ("calibration", "search", "validation")}
    assert (len(files["calibration"]), len(files["search"]), len(files["validation"])) == (4, 2, 2)
    assert not files["calibration"] & files["validation"] and not files["calibration"] & files["search"]

    def pixels(ds) -> set[int]:
        return {int(v) for f in ds.feeds for v in np.unique(f["x"][:, 0])}
    assert not pixels(s.calibration) & pixels(s.validation)  # what was drawn comes only from each set's files
    assert s.validation.kind == "images" and "2 images of model.images.source" in s.validation.source
    for ds in (s.search, s.validation):  # 2 images each: 2 samples, not the same images again at other shapes
        assert ds.samples == ds.distinct == 2 == len(pixels(ds)), (ds.purpose, ds.samples, pixels(ds))
        assert any("each used once" in n for n in ds.record()["notes"]), ds.record()
    assert s.validation.thin == ["only 2 distinct samples"]
    s = split(recipe=recipe, calibration_samples=16)  # 4 images left to calibrate on: 4 samples, and it says so
    assert s.calibration.samples == s.calibration.distinct == 4 and "calibration.samples=16" in s.calibration.notes[0]
    s = split(recipe=recipe, calibration_samples=3)  # 4 images left, 3 taken: the one left over is named
    assert s.calibration.samples == 3 and "1 are not used" in s.calibration.notes[0]
    for i in range(8, 80):
        Image.fromarray(np.full((8, 8, 3), i, np.uint8)).save(tmp_path / f"img{i}.png")
    s = split(recipe=recipe, calibration_samples=4, validation_samples=0)  # 80 images: 20 validate, 20 search
    assert s.validation.samples < 20 and any("are not used by its" in n for n in s.validation.record()["notes"])


def test_samples_repeated_inside_the_data_count_once_and_the_split_says_so():
    """8 samples saved as 24 (each three times): 8 distinct to split, no repeat inside a set or across sets."""
    data = user(8, batch=8)
    data.feeds = [{"x": np.concatenate([f["x"] for f in data.feeds] * 3)}]
    s = split(calibration_data=data)
    cal, search, val = ids(s.calibration), ids(s.search), ids(s.validation)
    assert (s.calibration.samples, s.search.samples, s.validation.samples) == (4, 2, 2)
    assert not (cal & search) and not (cal & val) and not (search & val)
    assert any("24 samples of which 8 are distinct: 16 repeats" in n for n in s.validation.notes)
    v = user(6, "validation.data", seed=1, batch=6)
    v.feeds = [{"x": np.concatenate([v.feeds[0]["x"][:2]] * 3)}]  # 2 samples, 3 times each
    s = split(calibration_data=user(8), validation_data=v)
    assert s.validation.samples == s.validation.distinct == 2 and "only 2 distinct samples" in s.validation.thin[0]
    assert "6 samples of which 2 are distinct" in s.validation.notes[0]
    assert s.summary()["validation"]["distinct"] == 2


def test_distinct_counts_a_set_whose_feeds_repeat():
    from tasks.data.sets import DataSet

    x = np.arange(2 * 3 * 8 * 8, dtype=np.float32).reshape(2, 3, 8, 8)
    ds = DataSet("validation", "file", "test", {}, make=lambda: [{"x": x}, {"x": x[:1]}, {"x": x[1:]}])
    assert (ds.samples, ds.distinct) == (4, 2) and ds.thin == ["only 2 distinct samples (of 4)"]


def test_calibration_data_alone_gives_validation_a_quarter_of_every_sample_and_names_what_is_not_used():
    """200 samples, calibration.samples=16: validation a quarter (50), the search 8, calibration 16; the 126 left
    over are named in the notes, not silently dropped."""
    s = split(calibration_data=user(200), calibration_samples=16)
    assert (s.validation.samples, s.search.samples, s.calibration.samples) == (50, 8, 16)
    assert "126 are not used (calibration.samples=16" in s.calibration.notes[0]
    s = split(calibration_data=user(372), calibration_samples=300)  # 64 + 8 + 300: every sample used
    assert (s.validation.samples, s.search.samples, s.calibration.samples) == (64, 8, 300)
    assert not s.calibration.notes


def test_a_static_profile_still_validates_on_many_samples():
    s = split_data(inputs=STATIC, profiles=STATIC_PROFILE, rules=ShapeRules(), calibrate=False, search=False,
                   validate=True, validation_samples=4)
    feeds = s.validation.feeds
    assert len(feeds) == 5 and s.validation.samples == 5  # the one static shape, then 4 fresh draws
    assert len({f["x"].tobytes() for f in feeds}) == 5
    assert s.validation.kind == "random" and s.validation.thin == [s.validation.thin[0]]  # random, but not too few


def test_generated_sets_are_disjoint_draws():
    s = split(calibration_samples=4)
    cal = {f["x"].tobytes() for f in s.calibration.feeds}
    val = {f["x"].tobytes() for f in s.validation.feeds}
    search = {f["x"].tobytes() for f in s.search.feeds}
    assert not cal & val and not cal & search and not search & val


def test_an_fp16_search_holds_its_samples_out_of_what_validates():
    """fp16 calibrates nothing but searches (the nodes to keep fp32): a quarter of calibration.data (at most 8) judges
    the search, the rest validates, disjoint; with validation.data given, calibration.data is the search's alone."""
    s = split(calibrate=False, calibration_data=user(16))
    search, val = ids(s.search), ids(s.validation)
    assert (len(search), len(val)) == (4, 12) and not (search & val) and search | val == set(range(16))
    assert s.calibration is None and "held out for the accuracy search" in s.search.source
    s = split(calibrate=False, calibration_data=user(12), validation_data=user(5, "validation.data", seed=1))
    assert len(ids(s.search)) == 8 and ids(s.validation) == {1000 + i for i in range(5)}
    s = split(calibrate=False, calibration_data=user(1))  # too few: the search judges generated inputs of its own
    assert s.search.kind == "random" and len(ids(s.validation)) == 1 and s.notes
    s = split(calibrate=False)  # no data: random draws from the search's own seeds, not the validation's
    assert s.search.kind == "random" and s.validation.kind == "random"
    assert s.search.key["seed"] != s.validation.key.get("seed")


def test_an_fp16_search_judges_the_data_validate_judges():
    """fp16 with validation.data alone: the search holds its samples out of validation.data (the kind of data validate
    judges: a search on random values met its target while the audio validate judged gave NaN), the rest validates;
    one sample is too few to hold out, and validates whole."""
    s = split(calibrate=False, validation_data=user(16, "validation.data", seed=1))
    search, val = ids(s.search), ids(s.validation)
    assert (len(search), len(val)) == (4, 12) and not (search & val) and search | val == {1000 + i for i in range(16)}
    assert s.search.kind == "file" and "held out for the accuracy search" in s.search.source
    assert any("less the samples held out for the fp16 accuracy search" in n for n in s.validation.notes)
    s = split(calibrate=False, validation_data=user(1, "validation.data", seed=1, batch=1))
    assert s.search.kind == "random" and ids(s.validation) == {1000} and s.notes
    s = split(calibrate=False, search=False, validation_data=user(16, "validation.data", seed=1))  # no search: all
    assert s.search is None and len(ids(s.validation)) == 16
    s = split(calibrate=False, validation_data=user(16, "validation.data", seed=1), labelled=True)  # labels: whole
    assert len(ids(s.validation)) == 16 and s.search.kind == "random"


def test_a_generated_fp16_search_judges_every_shape_validate_draws():
    """Random inputs: the search's held-out set holds every profile's min, opt and max and each shape validate draws
    (at its batch), each with content of its own."""
    profiles = PROFILE + [{"x": {"min": [1, 3, 16, 16], "opt": [2, 3, 16, 16], "max": [2, 3, 16, 16]}}]
    s = split_data(inputs=[TensorInfo("x", "float32", ["batch", 3, "h", "w"])], profiles=profiles, rules=ShapeRules(),
                   calibrate=False, search=True, validate=True, validation_samples=4, validation_seed=3)
    shapes = {tuple(f["x"].shape) for f in s.search.feeds}
    assert {tuple(f["x"].shape) for f in s.validation.feeds} <= shapes
    assert {(1, 3, 16, 16), (2, 3, 16, 16), (8, 3, 8, 8)} <= shapes
    assert not {f["x"].tobytes() for f in s.search.feeds} & {f["x"].tobytes() for f in s.validation.feeds}


def test_a_record_kept_by_a_cached_stage_describes_the_set_without_making_it_again():
    """summary.json's data figures of a cached build come from the record its stage kept (rendering a model's images
    takes seconds); a set whose content differs (another seed) does not take it."""
    made = split(validate=True, calibrate=False, search=False, validation_samples=5, validation_seed=3)
    kept = made.made_records()
    assert kept == {} and made.summary() == {}  # nothing made yet: nothing read, nothing described
    assert made.validation.feeds  # a stage reads it
    want = made.summary()
    kept = made.made_records()
    assert set(kept) == {"validation"} and kept["validation"]["record"] == want["validation"]

    def never() -> list:
        raise AssertionError("the data was made again")

    again = split(validate=True, calibrate=False, search=False, validation_samples=5, validation_seed=3)
    again.validation.make = never
    again.remember(kept)
    assert again.summary() == want and again.validation.samples == want["validation"]["samples"]
    other = split(validate=True, calibrate=False, search=False, validation_samples=5, validation_seed=4)
    other.remember(kept)
    assert not other.validation.made and other.summary() == {}  # its own content: not made only to be described
    assert other.validation.feeds and other.summary()["validation"]["samples"] >= 1
