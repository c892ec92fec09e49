"""The model as it will run, for validate and benchmark: the shipped engines (on a GPU) or their precision graphs in
ONNX Runtime, per TensorRT segment, composed with the native segments of a hybrid model."""
from __future__ import annotations

import contextlib
from pathlib import Path

from flows.context import BuildContext
from tasks.engines import engines_of
from tasks.common import StageResult


def deliverable(ctx: BuildContext) -> StageResult:
    """The stage whose engines ship: calibrate's quantized engines when it made them, else build's."""
    cal = ctx.results.get("calibrate")
    return cal if cal is not None and any(k.startswith("engine") for k in cal.files) else ctx.results["build"]


def candidate_runner(ctx: BuildContext, runners: contextlib.ExitStack | None = None, stage: str = "validate",
                     cuda_graph: bool = False):
    """The model as it will run: per TensorRT segment the engine (with `runners`: on a GPU, closed with it) or its
    precision graph in ONNX Runtime, the native segments of a hybrid model in ONNX Runtime between them."""
    from tasks.trt import gpu_for
    from tasks.onnxrt import precision_runner
    from tasks.onnxrt import ort_runner
    from tasks.trt import EngineRunner, runtime_cache_file
    from tasks.partition import composed_runner

    by_segment = {i: (eng, onnx) for i, eng, onnx in engines_of(deliverable(ctx))}
    cache = runtime_cache_file(ctx.cfg.cache_dir, ctx.cfg.target.name, ctx.backend.version)

    hybrid = bool(ctx.results["partition"].details.get("hybrid"))  # many sessions: no memory arena each

    def runner_for(seg: dict):
        if seg["kind"] != "trt":
            return ort_runner(ctx.results["partition"].files[f"segment{seg['index']}"], arena=not hybrid)
        eng, onnx = by_segment[seg["index"]]
        if runners is not None:
            gpu = gpu_for(ctx.cfg.target.compute_capability)  # the GPU this target runs on, not CUDA's device 0
            return runners.enter_context(EngineRunner(Path(eng).read_bytes(), ctx.backend, runtime_cache=cache,
                                                      cuda_graph=cuda_graph, stage=stage,
                                                      pci_bus_id=gpu.pci_bus_id if gpu else None)).infer
        # fp16 values rounded as TensorRT stores them (tasks/onnxrt/emulate.py: ONNX Runtime's CPU kernels would compute most
        # fp16 ops in fp32); Q/DQ as written (tasks/onnxrt/ort.py: a graph with Q/DQ runs at most at ONNX Runtime's basic
        # level, never fused into integer kernels, nor a weight-only DequantizeLinear -> MatMul turned into dynamic
        # quantization of the activations, which TensorRT's weight-only layers never do)
        return precision_runner(onnx, arena=not hybrid)[0]

    outputs = [o["name"] for o in ctx.results["export"].details["outputs"]]
    return composed_runner(ctx.results["partition"].details, outputs, runner_for)
