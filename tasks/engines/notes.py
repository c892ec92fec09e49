"""What the build stage says about the engines it does not build."""
from __future__ import annotations


def baseline_skip_reason(precision: str, baseline: str, compute_capability: str, benchmark: bool, hybrid: bool) -> str:
    """Why an int8/fp8 build makes no baseline engine: it is built only for the benchmark to time the quantized engine
    against, on a GPU of the target's compute capability."""
    from tasks.trt.backend import no_gpu_reason

    return (f"{precision}: the engine that ships is built in calibrate; the {baseline} baseline engine is built only to "
            f"time {precision} against it on a GPU of compute capability {compute_capability} (benchmark), and "
            + ("stages.benchmark=false" if not benchmark else
               "a hybrid model is timed end to end" if hybrid else no_gpu_reason(compute_capability)))
