"""What the accuracy search aims at and judges with (int8's in calibrate, fp16's in build): the judge of the user's
metric, its target, and when fp16's search of a model split into segments judges by cosine instead."""
from __future__ import annotations

from dataclasses import dataclass

from tasks.accuracy.budget import derived_margin, search_target
from tasks.accuracy.metric import Metric, SearchJudge


@dataclass(frozen=True)
class SearchGoal:
    judge: SearchJudge
    target: float  # what the search aims at: the cosine with its margin, or the judge's own target
    warning: str | None = None  # said once by the stage: why the search judges by cosine, not accuracy.metric

    @property
    def by_metric(self) -> bool:
        """The user's metric (not cosine) decides the stopping point: it belongs in the search's cache key."""
        return self.judge.name != "cosine"


def search_goal(metric: Metric, min_cosine: float, budget_margin: float, samples: int | None,
                segments: list[dict] | None = None, model_outputs: list[str] = (), hybrid: bool = False) -> SearchGoal:
    """The judge and target of an accuracy search under ``metric``. ``samples``: how many judge it (the margin grows
    below 8; None: the margin as given). int8's search (``segments`` None) judges by the metric always (a segment of a
    split model is judged through the rest of it); fp16's (``segments``: its TensorRT segments) when the one segment
    computes the model's outputs (``model_outputs``) from its inputs, else by the cosine of each segment's outputs."""
    margin = search_target(0.0, budget_margin, samples)  # the share of the error held in reserve
    warning = None
    if segments is None or metric.name == "cosine" or _whole_model(segments, model_outputs, hybrid):
        judge = metric.judge(margin)
    else:
        warning = (f"the model runs in {len(segments)} TensorRT segment(s) with parts in ONNX Runtime: the accuracy "
                   f"search judges each segment's own outputs by cosine (accuracy.min_cosine), then the segments "
                   f"together on the model's outputs by accuracy.metric={metric.name}, keeping whole segments fp32 "
                   f"where they miss it")
        judge = Metric(min_cosine=min_cosine).judge(margin)
    target = search_target(min_cosine, budget_margin, samples) if judge.name == "cosine" else judge.target
    return SearchGoal(judge, target, warning)


@dataclass(frozen=True)
class SearchMargin:
    """The share of the allowed error the search keeps in reserve, and what it was derived from."""
    share: float
    derived: bool  # from the samples and candidates (tasks/accuracy/budget.py), else calibration.budget_margin
    held_out: int
    judged: int
    candidates: int
    validated: int | None

    def metrics(self) -> dict:
        return {"search_margin": self.share, "search_candidates": self.candidates}

    @property
    def words(self) -> str:
        if not self.derived:
            return f"calibration.budget_margin={self.share:g} of the allowed error, as given"
        return (f"{self.share:.3f} of the allowed error, derived from {self.held_out} held-out of {self.judged} judged "
                f"samples, up to {self.candidates} candidates judged"
                + (f" and {self.validated} validation samples" if self.validated else ""))


def search_margin(budget_margin: float | None, held_out: int, judged: int, layers: int,
                  validated: int | None) -> SearchMargin:
    """The search's margin: ``budget_margin`` as given (then grown for few judged samples by ``search_goal``), or when
    None derived from the held-out and judged samples, the candidates a search on ``layers`` layers may judge and
    validate's samples (tasks.accuracy.budget.derived_margin)."""
    from tasks.search.judging import JUDGE_Z
    from tasks.search.restore import planned_judgements

    k = planned_judgements(layers)
    if budget_margin is not None:
        return SearchMargin(float(budget_margin), False, held_out, judged, k, validated)
    return SearchMargin(derived_margin(held_out or judged, judged, k, validated, JUDGE_Z), True, held_out, judged, k,
                        validated)


def _whole_model(segments: list[dict], model_outputs: list[str], hybrid: bool) -> bool:
    """Whether the one TensorRT segment computes the model's outputs from its inputs."""
    from tasks.graph.load import load_onnx
    from tasks.graph.models import graph_io

    outs = graph_io(load_onnx(segments[0]["onnx"]))[1] if len(segments) == 1 else []
    return len(segments) == 1 and sorted(o.name for o in outs) == sorted(model_outputs) and not hybrid
