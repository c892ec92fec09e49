"""A model whose fp32 reference goes NaN (Log of a noise level <= 0, as a diffusion UNet's) built through the real
flow: at fp16 on generated random inputs (of -sigma: a domain the graph does not show), validate compares it on the
finite part, says so, and names the input the random values went into and asks for validation.data; at int8 on
calibration data holding such samples, the calibrate stage reports it and the search quantizes every layer."""
from __future__ import annotations

import pytest

from tests.conftest import model_conf
from tests.flows.test_build_flow import build
from tests.tasks.quantization.test_nonfinite_search import log_model

PROFILE = "{x: {min: [4, 16], opt: [4, 16], max: [4, 16]}, sigma: {min: [4, 1], opt: [4, 1], max: [4, 1]}}"


@pytest.mark.slow
def test_a_reference_nan_on_random_inputs_is_reported_and_compared_on_the_finite_part(prefect_harness, tmp_path):
    # Log(-sigma): a domain the graph does not show (a Log of sigma itself draws positive values: tasks/graph/meaning.py)
    conf = model_conf(tmp_path, "lognoise", log_model(tmp_path / "lognoise.onnx", negated=True), PROFILE)
    s = build(["model=lognoise", "precision=fp16", "target=sm_86"], conf, tmp_path)
    assert s["status"] == "ok", s.get("error")
    warnings = s["stages"]["validate"]["warnings"]
    assert any("the fp32 reference output 'y' is not finite" in w and "node 'log' (Log)" in w and
               "random values of input(s) sigma (those that reach it)" in w and "validation.data=PATH" in w
               for w in warnings), warnings
    assert any("output 'y' compared on the finite part" in w for w in warnings), warnings
    assert "build at fp32" not in str(s)


@pytest.mark.slow
def test_int8_with_a_reference_nan_in_the_calibration_data_quantizes_every_layer(prefect_harness, tmp_path):
    """The same class at int8, on the user's calibration data (int8 needs data): a sigma <= 0 in some of its samples
    makes NaN that passes through a MatMul. The calibrate stage warns of it with the node, the search judges the
    finite part of the reference, and validate compares on the finite part."""
    import numpy as np

    from tests.tasks.quantization.test_nonfinite_search import log_feeds

    feeds = log_feeds(16, 0)
    np.savez(tmp_path / "cal.npz", **{k: np.stack([f[k] for f in feeds]) for k in ("x", "sigma")})
    conf = model_conf(tmp_path, "lognoise8", log_model(tmp_path / "lognoise8.onnx"), PROFILE)
    s = build(["model=lognoise8", "precision=int8", "target=sm_86", f"calibration.data={tmp_path / 'cal.npz'}",
               "stages.benchmark=false"], conf, tmp_path)
    warnings = s["stages"]["calibrate"]["warnings"]
    assert any("the fp32 reference output 'y' is not finite" in w and "node 'log' (Log)" in w
               and "the search leaves those elements out" in w for w in warnings), warnings
    # every layer quantized is judged on the finite part (NaN rows counted as errors gave 0.77 on the unit test's data)
    assert s["status"] == "ok" and s["metrics"]["search_cosine_all_quantized"] > 0.95, s["metrics"]
    assert any("compared on the finite part" in w for w in s["stages"]["validate"]["warnings"])
