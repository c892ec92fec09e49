"""A model whose fp32 reference goes NaN on the generated random inputs (Log of a noise level <= 0, as a diffusion
UNet's), built at fp16 through the real flow: validate compares it on the finite part, says so, and the summary's
validate warnings name the input the random values went into and ask for validation.data."""
from __future__ import annotations

import pytest

from tests.conftest import model_conf
from tests.flows.test_build_flow import build
from tests.tasks.evaluate.test_nonfinite_reference import log_model


@pytest.mark.slow
def test_a_reference_nan_on_random_inputs_is_reported_and_compared_on_the_finite_part(prefect_harness, tmp_path):
    conf = model_conf(tmp_path, "lognoise", log_model(tmp_path / "lognoise.onnx"),
                      "{sigma: {min: [1, 16], opt: [1, 16], max: [1, 16]}}")
    s = build(["model=lognoise", "precision=fp16", "target=sm_86"], conf, tmp_path)
    assert s["status"] == "ok", s.get("error")
    warnings = s["stages"]["validate"]["warnings"]
    assert any("the fp32 reference output 'y' is not finite" in w and "random values of input(s) sigma (those that reach it)"
               in w and "validation.data=PATH" in w for w in warnings), warnings
    assert any("output 'y' compared on the finite part" in w for w in warnings), warnings
    assert "build at fp32" not in str(s)
