"""What the accuracy search aims at and judges with (int8's in calibrate, fp16's in build): the judge of the user's
metric, its target, and when fp16's search of a model split into segments judges by cosine instead."""
from __future__ import annotations

from dataclasses import dataclass

from tasks.accuracy.budget import search_target
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
                   f"search judges each segment's own outputs by cosine (accuracy.min_cosine); "
                   f"accuracy.metric={metric.name} gates validate")
        judge = Metric(min_cosine=min_cosine).judge(margin)
    target = search_target(min_cosine, budget_margin, samples) if judge.name == "cosine" else judge.target
    return SearchGoal(judge, target, warning)


def _whole_model(segments: list[dict], model_outputs: list[str], hybrid: bool) -> bool:
    """Whether the one TensorRT segment computes the model's outputs from its inputs."""
    from tasks.graph.load import load_onnx
    from tasks.graph.models import graph_io

    outs = graph_io(load_onnx(segments[0]["onnx"]))[1] if len(segments) == 1 else []
    return len(segments) == 1 and sorted(o.name for o in outs) == sorted(model_outputs) and not hybrid
