"""The accuracy-budget search as a pure function of per-layer scores (tasks/search.py)."""
from tasks.search import budget_search


def additive(losses: dict[str, float], none: float = 1.0):
    """A score where each quantized layer loses its own amount (effects add up)."""
    return lambda names: none - sum(losses[n] for n in names)


def test_a_layer_ranked_first_that_alone_breaks_the_budget_does_not_stop_the_search():
    # 'big' moves the most FLOPs for its loss (ranked first) but alone breaks the budget; 'a' and 'b' together meet it
    losses = {"big": 0.02, "a": 0.004, "b": 0.004}
    score = additive(losses)
    alone = {n: score([n]) for n in losses}
    flops = {"big": 1e12, "a": 1e6, "b": 1e6}
    r = budget_search(list(losses), score, 0.99, 1.0, alone, flops)
    assert r.ranking[0]["node"] == "big" and not r.ranking[0]["eligible"]
    assert sorted(r.chosen) == ["a", "b"] and r.score >= 0.99


def test_the_longest_prefix_within_budget_then_greedy():
    losses = {f"l{i}": 0.001 * (i + 1) for i in range(8)}  # l0 cheapest ... l7 most costly
    score = additive(losses)
    alone = {n: score([n]) for n in losses}
    r = budget_search(list(losses), score, 0.99, 1.0, alone)
    # 0.001 + 0.002 + 0.003 = 0.006; + 0.004 = 0.010 just meets 0.99
    assert r.chosen == ["l0", "l1", "l2", "l3"] and abs(r.score - 0.99) < 1e-12
    assert sum(losses[n] for n in r.chosen) <= 0.01 + 1e-12


def test_greedy_pass_takes_a_later_layer_that_still_fits():
    losses = {"a": 0.004, "b": 0.0065, "c": 0.0005}
    score = additive(losses)
    alone = {n: score([n]) for n in losses}
    flops = {"a": 100.0, "b": 100.0, "c": 1.0}  # c: least FLOPs, so ranked last despite its small loss
    r = budget_search(list(losses), score, 0.99, 1.0, alone, flops)
    assert r.chosen[:1] == ["a"] and "c" in r.chosen and "b" not in r.chosen


def test_nothing_fits_gives_an_empty_choice_at_the_unquantized_score():
    losses = {"a": 0.05, "b": 0.06}
    score = additive(losses)
    alone = {n: score([n]) for n in losses}
    r = budget_search(list(losses), score, 0.99, 1.0, alone)
    assert r.chosen == [] and r.score == 1.0 and not any(row["eligible"] for row in r.ranking)


def test_everything_fits():
    losses = {"a": 0.001, "b": 0.001}
    score = additive(losses)
    r = budget_search(list(losses), score, 0.99, 1.0, {n: score([n]) for n in losses})
    assert sorted(r.chosen) == ["a", "b"]
