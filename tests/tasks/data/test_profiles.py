import numpy as np
import pytest

from tasks.common.errors import ConfigError
from tasks.graph.models import TensorInfo
from tasks.data.profiles import ShapeRules, check_profiles, shapes_in_profile

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
    shapes = shapes_in_profile(p, 20, np.random.default_rng(0), ShapeRules(multiples={"x": [1, 1, 32, 32]}))
    assert shapes[0]["x"] == [1, 3, 32, 32] and shapes[1]["x"] == [1, 3, 640, 640] and shapes[2]["x"] == [4, 3, 1280, 1280]
    for s in shapes:
        n, c, h, w = s["x"]
        assert 1 <= n <= 4 and 32 <= h <= 1280 and h % 32 == 0 and w % 32 == 0
    assert len({tuple(s["x"]) for s in shapes}) > 5  # really random in between


def two_input_model(names_a=("batch", "seq"), names_b=("batch", "seq"), op="Add"):
    """a, b -> op(a, b) -> y: the smallest model whose inputs must agree (like input_ids and attention_mask)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node(op, ["a", "b"], ["y"], name="combine")], "two",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, list(names_a)),
                               helper.make_tensor_value_info("b", TensorProto.FLOAT, list(names_b))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def inputs_of(model):
    from tasks.graph.models import graph_io

    return graph_io(model)[0]


def two(seq_a, seq_b):
    return [{"a": {"min": [1, seq_a[0]], "opt": [2, seq_a[1]], "max": [4, seq_a[2]]},
             "b": {"min": [1, seq_b[0]], "opt": [2, seq_b[1]], "max": [4, seq_b[2]]}}]


@pytest.mark.parametrize("names_b, why", [(("batch", "seq"), "the model's dim 'seq'"),
                                          (("m", "t"), "node 'combine' (Add)")])
def test_profiles_contradicting_dims_the_model_ties_are_refused_naming_both_inputs(names_b, why):
    from tasks.data.profiles import shape_rules

    model = two_input_model(names_b=names_b)
    ins = inputs_of(model)
    profiles = check_profiles(two((1, 32, 128), (1, 64, 128)), ins)
    with pytest.raises(ConfigError) as e:
        shape_rules(ins, profiles, model)
    msg = str(e.value)
    assert "'a' dim 1" in msg and "'b' dim 1" in msg and why in msg and "1/32/128" in msg
    assert "fix: give 'b' dim 1 the same range as 'a'" in msg and "opt: [2, 32]" in msg
    shape_rules(ins, check_profiles(two((1, 32, 128), (1, 32, 128)), ins), model)  # agreeing profiles pass


def test_a_dim_fixed_at_1_may_broadcast_but_not_a_shared_name():
    from tasks.data.profiles import shape_rules

    model = two_input_model(names_b=("m", "t"))
    ins = inputs_of(model)
    shape_rules(ins, check_profiles(two((1, 32, 128), (1, 1, 1)), ins), model)
    named = two_input_model()
    with pytest.raises(ConfigError, match="'seq'"):
        shape_rules(inputs_of(named), check_profiles(two((1, 32, 128), (1, 1, 1)), inputs_of(named)), named)


def test_tied_dims_are_drawn_as_one_value_everywhere():
    from tasks.data.inputs import calibration_shapes, heldout_shapes
    from tasks.data.profiles import shape_rules

    model = two_input_model(names_b=("m", "t"))  # tied by the graph only
    ins = inputs_of(model)
    prof = check_profiles(two((1, 32, 128), (1, 32, 128)), ins)
    rules = shape_rules(ins, prof, model)
    rng = np.random.default_rng(0)
    drawn = shapes_in_profile(prof[0], 30, rng, rules)
    assert all(s["a"] == s["b"] for s in drawn) and len({tuple(s["a"]) for s in drawn}) > 10
    for s in calibration_shapes(prof[0], 8, rng, rules) + heldout_shapes(prof[0], 8, rng, rules):
        assert s["a"] == s["b"]


def test_profiles_alone_tie_inputs_with_identical_ranges_without_refusing():
    from tasks.data.profiles import shape_rules

    ins = [TensorInfo("input_ids", "int64", ["input_ids_dim0", "input_ids_dim1"]),
           TensorInfo("attention_mask", "int64", ["attention_mask_dim0", "attention_mask_dim1"])]
    prof = [{n: {"min": [1, 1], "opt": [2, 64], "max": [16, 128]} for n in ("input_ids", "attention_mask")}]
    rules = shape_rules(ins, check_profiles(prof, ins))
    assert all(s["input_ids"] == s["attention_mask"] for s in shapes_in_profile(prof[0], 20, np.random.default_rng(3), rules))
    prof[0]["attention_mask"] = {"min": [1, 1], "opt": [2, 32], "max": [16, 64]}  # different ranges: independent
    shape_rules(ins, check_profiles(prof, ins))


def test_alignment_is_inferred_from_the_profile_when_no_shape_multiple_is_given():
    from tasks.data.profiles import infer_multiples, shape_rules

    det = prof([1, 3, 320, 320], [4, 3, 640, 640], [8, 3, 640, 640])
    assert infer_multiples(det) == {"x": [1, 1, 64, 64]}
    assert infer_multiples(prof([1, 3, 32, 32], [1, 3, 96, 96], [2, 3, 160, 160])) == {"x": [1, 1, 32, 32]}
    assert infer_multiples(prof([1, 3, 48, 17], [1, 3, 48, 100], [1, 3, 48, 320])) == {}
    rules = shape_rules(X, check_profiles(det, X))
    assert rules.inferred == {"x": [1, 1, 64, 64]}
    for s in shapes_in_profile(check_profiles(det, X)[0], 40, np.random.default_rng(0), rules):
        assert s["x"][2] % 64 == 0 and s["x"][3] % 64 == 0  # never [7, 3, 524, 484]
    given = shape_rules(X, check_profiles(det, X), multiples={"x": [1, 1, 32, 32]})
    assert given.inferred == {} and given.multiples == {"x": [1, 1, 32, 32]}
    with pytest.raises(ConfigError, match="did you mean 'x'"):
        shape_rules(X, check_profiles(det, X), multiples={"xx": [1, 1, 32, 32]})
