"""Composition and the whole-config check: bad input is refused before any heavy work, saying how to fix it."""
import pytest

from flows.config import compose_config, preflight
from tasks.common.errors import ConfigError


def refused(overrides, config_dir=None) -> str:
    with pytest.raises(ConfigError) as e:
        preflight(compose_config(overrides, config_dir), config_dir)
    return str(e.value)


def test_defaults_are_ppocr_det_fp16_and_every_target_composes():
    cfg = compose_config([])
    assert (cfg.model.name, cfg.target.name, cfg.precision.name) == ("ppocr_det", "sm_86", "fp16")
    from flows.config import options
    targets = options("target")
    for t in ("sm_35", "sm_53", "sm_62", "sm_72", "sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_100", "sm_120", "sm_121"):
        assert t in targets
        c = compose_config([f"target={t}"])
        assert c.target.name == t and c.target.gpus and c.target.architecture


@pytest.mark.parametrize("overrides, words", [
    (["precison=fp16"], "did you mean 'precision'"),
    (["model.profile=[]"], "did you mean 'profiles'"),
    (["validation.sample=3"], "did you mean 'samples'"),
    (["target=sm_99"], "valid targets"),
    (["model=ppocr_dett"], "did you mean model=ppocr_det"),
    (["accuracy.min_cosine=high"], "accuracy.min_cosine"),
])
def test_composition_errors_name_the_key_and_suggest(overrides, words):
    with pytest.raises(ConfigError) as e:
        compose_config(overrides)
    assert words in str(e.value)


@pytest.mark.parametrize("overrides, words", [
    (["target=sm_30"], "not supported"),
    (["target=sm_20"], "not supported"),
    (["precision=fp8", "target=sm_86"], "fp8 needs sm_89"),
    (["precision=int8", "model=tiny"], "needs calibration data"),
    (["model=tiny", "model.name=../evil"], "not a safe name"),
    (["model=tiny", "model.profiles=[{x: {min: [1,3,64,64], opt: [1,3,32,32], max: [1,3,128,128]}}]"], "min <= opt <= max"),
    (["model=tiny", "model.profiles=[{x: {min: [1,3,8], opt: [1,3,8], max: [1,3,8]}}]"], "rank"),
    (["model=tiny", "model.profiles=[{image: {min: [1,3,8,8], opt: [1,3,8,8], max: [1,3,8,8]}}]"], "no input 'image'"),
    (["model=tiny", "model.source=/does/not/exist.onnx"], "file not found"),
    (["model=tiny", "calibration.method=kl"], "entropy, minmax or percentile"),
    (["model=tiny", "model.asymmetric=uint8"], "use exact, int8 or float"),
    (["model=tiny", "model.format=tf"], "model.format='tf' is not supported"),
    (["model=tiny", "model.reference=float"], "use shipped or dequantized"),
    (["model=tiny", "validation.data=/no/such/data.npz"], "validation.data"),
    (["model=tiny", "model.images.source=synthetic:text"], "model.images is not set in this config"),
])
def test_bad_input_is_refused_before_heavy_work(overrides, words, user_config_dir):
    msg = refused(overrides, str(user_config_dir))
    assert words in msg and "fix:" in msg


@pytest.mark.parametrize("recipe, words", [
    ("channel_order: YUV", "model.images.channel_order='YUV' is unknown"),
    ("layout: NWHC", "use NCHW or NHWC"),
    ("channel_order: gray", "channel_order=gray gives 1 channel(s), but input 'x' has 3"),
    ("{channel_order: GRAY, mean: [0.4, 0.5, 0.6]}", "channel_order=GRAY gives one channel"),
    ("{std: [0.5, 0.0, 0.5]}", "has a 0"),
])
def test_an_images_recipe_that_cannot_feed_the_input_is_refused(recipe, words, tmp_path, tiny_onnx):
    """model.images: its channel order and layout are known ones (GRAY, RGB, BGR in any case), its mean and std hold a
    value per channel, and it gives the input the channels the model fixes (tiny's x: 3)."""
    extra = recipe.strip("{}")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "t.yaml").write_text(
        f"name: t\nformat: onnx\nsource: {tiny_onnx}\n"
        "profiles:\n  - x: {min: [1, 3, 8, 8], opt: [2, 3, 16, 16], max: [4, 3, 32, 32]}\n"
        f"images: {{source: 'synthetic:text', input: x, height: 16, width: 16, {extra}}}\n")
    msg = refused(["model=t", "precision=int8"], str(tmp_path))
    assert words in msg and "fix:" in msg


def test_sm_90_needs_enterprise_tensorrt_on_that_gpu(user_config_dir):
    from tasks.trt.backend import gpu_for
    from tasks.common.errors import UnavailableError

    if gpu_for("9.0"):
        pytest.skip("this host has an sm_90 GPU")
    with pytest.raises(UnavailableError) as e:
        preflight(compose_config(["model=tiny", "target=sm_90"], str(user_config_dir)), str(user_config_dir))
    assert "Enterprise TensorRT" in str(e.value) and "sm_89" in str(e.value)


def test_corrupt_model_in_user_config_dir(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "broken.onnx").write_bytes(b"not an onnx file at all")
    (tmp_path / "model" / "broken.yaml").write_text("name: broken\nsource: broken.onnx\n")
    msg = refused(["model=broken"], str(tmp_path))
    assert "broken.onnx" in msg and "not a readable ONNX model" in msg


def test_unknown_key_in_a_user_model_yaml_is_refused(tmp_path, tiny_onnx):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "typo.yaml").write_text(f"name: typo\nsource: {tiny_onnx}\nprofile: []\n")
    with pytest.raises(ConfigError) as e:
        compose_config(["model=typo"], str(tmp_path))
    assert "profiles" in str(e.value)


def test_calibration_data_is_checked_against_the_model(tmp_path, user_config_dir):
    import numpy as np

    np.savez(tmp_path / "wrong_name.npz", image=np.zeros((1, 3, 16, 16), np.float32))
    np.savez(tmp_path / "wrong_dtype.npz", x=np.zeros((1, 3, 16, 16), np.float64))
    np.savez(tmp_path / "too_big.npz", x=np.zeros((1, 3, 64, 64), np.float32))
    np.savez(tmp_path / "nan.npz", x=np.full((1, 3, 16, 16), np.nan, np.float32))
    for f, words in [("wrong_name", "model's inputs are ['x']"), ("wrong_dtype", "float64"),
                     ("too_big", "outside every profile"), ("nan", "NaN")]:
        msg = refused(["model=tiny", "precision=int8", f"calibration.data={tmp_path / (f + '.npz')}"], str(user_config_dir))
        assert words in msg, msg


def test_a_profile_that_contradicts_the_graph_is_refused_naming_both_inputs(two_input_conf):
    bad = "model.profiles=[{input_ids: {min: [1,1], opt: [2,16], max: [4,32]}, attention_mask: {min: [1,1], opt: [2,8], max: [4,16]}}]"
    msg = refused(["model=encoder", bad], str(two_input_conf))
    assert "'input_ids' dim 1" in msg and "'attention_mask' dim 1" in msg and "1/16/32" in msg and "masked_scores" in msg
    assert "fix: give 'attention_mask' dim 1 the same range as 'input_ids'" in msg
    facts = preflight(compose_config(["model=encoder"], str(two_input_conf)), str(two_input_conf))
    tied = {(t.a, t.b) for t in facts.rules.ties if t.hard}
    assert (("input_ids", 0), ("attention_mask", 0)) in tied and (("input_ids", 1), ("attention_mask", 1)) in tied
    msg = refused(["model=encoder", "+model.shape_multiple.input_ids=[1,8,8]"], str(two_input_conf))
    assert "model.shape_multiple.input_ids" in msg and "2 positive dims" in msg


def test_adding_an_entry_to_a_map_says_to_use_plus(two_input_conf):
    with pytest.raises(ConfigError) as e:
        compose_config(["model=encoder", "model.shape_multiple={input_ids: [1, 8]}"], str(two_input_conf))
    assert "fix: add it with a leading '+': +model.shape_multiple={input_ids: [1, 8]}" in str(e.value)


@pytest.fixture(scope="module")
def if_conf(tmp_path_factory, if_onnx):
    d = tmp_path_factory.mktemp("ifconf")
    (d / "model").mkdir()
    (d / "model" / "vad.yaml").write_text(f"name: vad\nformat: onnx\nsource: {if_onnx}\nconstants: {{mode: 16000}}\n"
                                          "profiles:\n  - x: {min: [1, 4], opt: [2, 4], max: [4, 4]}\n")
    return str(d)


@pytest.mark.parametrize("overrides, words", [
    (["+model.constants.rate=8000"], ["model.constants.rate=8000", "no input 'rate'", "x, mode"]),
    (["+model.constants.mod=8000"], ["model.constants.mod=8000", "did you mean 'mode'", "x, mode"]),
    (["model.constants.mode=[16000]"], ["model.constants.mode=[16000]", "rank 0"]),
    (["model.profiles=[{x: {min: [1,4], opt: [1,4], max: [1,4]}, mode: {min: [], opt: [], max: []}}]"],
     ["model.profiles[0].mode", "model.constants.mode"]),
])
def test_constants_are_checked_against_the_inputs(if_conf, overrides, words):
    msg = refused(["model=vad", *overrides], if_conf)
    assert all(w in msg for w in words) and "fix:" in msg, msg


def test_bound_inputs_are_no_inputs_for_profiles_and_data(if_conf):
    facts = preflight(compose_config(["model=vad"], if_conf), if_conf)
    assert [i.name for i in facts.inputs] == ["x"] and list(facts.profiles[0]) == ["x"]


def test_the_build_key_includes_the_constants(if_conf):
    from flows.cache import build_key

    keys = {build_key(compose_config(["model=vad", *o], if_conf), if_conf) for o in ([], ["model.constants.mode=8000"])}
    assert len(keys) == 2


def test_the_declared_values_are_the_ones_preflight_names():
    """Each key with a fixed set of values declares it once in the schema; preflight's message lists exactly those."""
    from tasks.schema import CALIBRATION_METHODS, PRECISIONS, choices_of
    from tasks.quantization.ranges import METHODS

    assert choices_of("calibration.method") == CALIBRATION_METHODS == tuple(METHODS)
    assert choices_of("precision.name") == PRECISIONS and choices_of("model.name") == ()
