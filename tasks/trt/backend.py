"""The one adapter between trtforge and a TensorRT implementation.

TensorRT-RTX (`tensorrt_rtx_bindings`) is the embedded default: it builds engines for sm_75/80/86/89/120/121
on any machine, GPU or not (CPU-only AOT via `set_compute_capability`). Enterprise TensorRT (`tensorrt`)
has the same API but builds for the GPU it runs on; targets such as sm_90 select it in `conf/target/`.
TensorRT is imported lazily, only by the stages that need it. What its messages mean and the fixes they suggest:
messages.py.
"""
from __future__ import annotations

import importlib
import subprocess
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from tasks.common.errors import StageError, UnavailableError
from tasks.common.native import deferred_signals, signal_pending
from tasks.common.errors import NOISE
from tasks.trt.messages import builder_fix, clean_message, node_named_in, route_around, unique

MODULES = {"tensorrt_rtx": "tensorrt_rtx_bindings", "tensorrt": "tensorrt"}
INSTALL = {
    "tensorrt_rtx": "pip install tensorrt-rtx-cu13-bindings==1.7.1.116 tensorrt-rtx-cu13-libs==1.7.1.116",
    "tensorrt": "install Enterprise TensorRT (pip install tensorrt from NVIDIA's index) on a GPU host of this architecture",
}
DISTRIBUTIONS = {"tensorrt_rtx": ("tensorrt-rtx-cu13-bindings", "tensorrt-rtx-cu12-bindings"),
                 "tensorrt": ("tensorrt", "tensorrt-cu13", "tensorrt-cu12")}


def installed_version(name: str) -> str:
    """The backend's installed version from package metadata, without importing TensorRT (for up-to-date checks)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in DISTRIBUTIONS.get(name, ()):
        try:
            return f"{name}-{dist}-{version(dist)}"
        except PackageNotFoundError:
            continue
    return f"{name}-not-installed"


@dataclass
class GpuInfo:
    name: str
    compute_capability: str
    driver: str
    pci_bus_id: str = ""  # how the engine runner finds this GPU's CUDA device (nvidia-smi's order is not CUDA's)


NVIDIA_SMI_QUERY = "--query-gpu=name,compute_cap,driver_version,pci.bus_id"


def gpus_from_nvidia_smi(text: str) -> tuple[GpuInfo, ...]:
    """GPUs from ``nvidia-smi --query-gpu=name,compute_cap,driver_version,pci.bus_id --format=csv,noheader``."""
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.rsplit(",", 3)]  # a GPU's name may hold a comma; the other fields do not
        if len(parts) == 4:
            gpus.append(GpuInfo(*parts))
    return tuple(gpus)


@lru_cache(maxsize=1)
def host_gpus() -> tuple[GpuInfo, ...]:
    """NVIDIA GPUs on this host, from nvidia-smi (empty when there is no driver or GPU)."""
    try:
        out = subprocess.run(["nvidia-smi", NVIDIA_SMI_QUERY, "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return gpus_from_nvidia_smi(out)


def gpu_for(compute_capability: str) -> GpuInfo | None:
    return next((g for g in host_gpus() if g.compute_capability == compute_capability), None)


def no_gpu_reason(compute_capability: str) -> str:
    gpus = host_gpus()
    if not gpus:
        return f"no NVIDIA GPU on this host; running the engine needs a GPU of compute capability {compute_capability}"
    have = ", ".join(f"{g.name} ({g.compute_capability})" for g in gpus)
    return f"this host's GPUs ({have}) cannot run an engine built for compute capability {compute_capability}"


def collecting_logger(trt, gpu_less: bool | None = None):
    """The project's one TensorRT logger (every builder, parser and runtime gets one: Backend.logger): it prints
    nothing (TensorRT's own Logger writes every message to stderr) and keeps warnings and errors for error reports, each
    message once (the parser reports one failure at every level it passes). On a host without a GPU (``gpu_less``,
    default: nvidia-smi finds none) the CUDA runtime's lines about the missing driver ("cudaError 35: CUDA driver version
    is insufficient", checkMacros.cpp::catchCudaError) are dropped as they arrive: parsing and building never need the
    GPU, so they say nothing there; on a GPU host they are kept (a driver too old for the engine is a real fault). A
    subclass of the loaded module's ILogger, made when TensorRT is imported."""
    drop = (not host_gpus()) if gpu_less is None else gpu_less

    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.messages: list[tuple[str, str]] = []
            self.dropped = 0  # the GPU-less driver lines left out

        def log(self, severity, msg):
            if severity > trt.ILogger.Severity.WARNING:
                return
            if drop and NOISE.search(msg):
                self.dropped += 1
                return
            entry = (str(severity).rsplit(".", 1)[-1], msg)
            if entry not in self.messages:
                self.messages.append(entry)

        def errors(self) -> list[str]:
            """Error messages without GPU-less driver noise (cudaError 35 on a host without a driver), each once."""
            return unique(clean_message(m) for s, m in self.messages
                          if s in ("ERROR", "INTERNAL_ERROR") and not NOISE.search(m))

    return Logger()


@dataclass
class SupportReport:
    subgraphs: list[dict] = field(default_factory=list)  # {"nodes": [int], "supported": bool}
    errors: list[dict] = field(default_factory=list)  # {"node": int, "name": str, "op": str, "reason": str}
    fully_supported: bool = False


def backend_for_target(name: str, backend: str, compute_capability: str, architecture: str = "", note: str = "") -> "Backend":
    """The backend that builds for a target, or a plain refusal. Enterprise TensorRT builds for the GPU it runs on,
    so a target it serves needs a GPU of that architecture on this host (checked before looking for the module)."""
    if backend == "tensorrt" and gpu_for(compute_capability) is None:
        raise UnavailableError(
            f"target={name} ({architecture}) needs Enterprise TensorRT on a GPU of compute capability "
            f"{compute_capability}: {no_gpu_reason(compute_capability)}" + (f" ({note})" if note else ""),
            fix="run the build on such a GPU host (a build-farm worker), or pick a TensorRT-RTX target that builds "
                "anywhere: sm_75, sm_80, sm_86, sm_89, sm_120, sm_121")
    b = Backend(backend)
    b.compute_capability_enum(compute_capability)  # TensorRT-RTX: refuse a compute capability it cannot target
    return b


class Backend:
    """TensorRT behind a small surface: version, support check, engine build, engine validity."""

    def __init__(self, name: str):
        if name not in MODULES:
            raise UnavailableError(f"unknown backend {name!r}", fix=f"use one of {sorted(MODULES)}")
        self.name = name
        try:
            self.trt = importlib.import_module(MODULES[name])
        except ImportError as e:
            raise UnavailableError(f"backend {name!r} is not installed here ({e})", fix=INSTALL[name]) from None

    @property
    def version(self) -> str:
        return f"{self.name}-{self.trt.__version__}"

    def compute_capability_enum(self, compute_capability: str):
        if self.name != "tensorrt_rtx":
            return None
        member = "SM" + compute_capability.replace(".", "")
        cc = getattr(self.trt.ComputeCapability, member, None)
        if cc is None:
            valid = [m for m in self.trt.ComputeCapability.__members__ if m.startswith("SM")]
            raise UnavailableError(f"TensorRT-RTX {self.trt.__version__} cannot target compute capability {compute_capability}",
                                   fix=f"it targets {', '.join(valid)}; use Enterprise TensorRT for others")
        return cc

    def logger(self):
        """A new TensorRT logger for one builder, parser or runtime (collecting_logger: prints nothing, keeps the
        warnings and errors, without GPU-less driver noise)."""
        return collecting_logger(self.trt)

    def runtime(self, logger=None):
        """A TensorRT runtime with the project's logger (``logger``, default a new one)."""
        return self.trt.Runtime(logger if logger is not None else self.logger())

    def parser(self, logger=None) -> tuple[Any, Any, Any]:
        """(builder, network, ONNX parser) with the project's logger (``logger``, default a new one): the network
        strongly typed, as every build here is (TensorRT-RTX networks always are; Enterprise TensorRT 10 needs the
        flag). Keep the builder and parser alive while using the network."""
        trt = self.trt
        logger = logger if logger is not None else self.logger()
        builder = trt.Builder(logger)
        flags = 0
        if self.name == "tensorrt" and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
            flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        network = builder.create_network(flags)
        return builder, network, trt.OnnxParser(network, logger)

    def support_report(self, model_bytes: bytes, model_path: str) -> SupportReport:
        builder, network, parser = self.parser()  # noqa: F841 - alive while the parser works
        report = SupportReport()
        with deferred_signals():
            report.fully_supported = bool(parser.supports_model_v2(model_bytes, model_path))
        for i in range(parser.num_subgraphs):
            report.subgraphs.append({"nodes": [int(n) for n in parser.get_subgraph_nodes(i)],
                                     "supported": bool(parser.is_subgraph_supported(i))})
        for i in range(parser.num_errors):
            err = parser.get_error(i)
            report.errors.append({"node": int(err.node()), "name": err.node_name(), "op": err.node_operator(),
                                  "reason": clean_message(err.desc())})
        return report

    def parse_errors(self, model_bytes: bytes, model_path: str = "") -> list[dict]:
        """A full parse (what the builder will see); [] when it parses, else the parser's errors."""
        logger = self.logger()
        builder, network, parser = self.parser(logger)  # noqa: F841 - alive while the parser works
        with deferred_signals():
            parsed = parser.parse(model_bytes, model_path)
        if parsed:
            return []
        errs = [parser.get_error(i) for i in range(parser.num_errors)]
        return [{"node": int(e.node()), "name": e.node_name(), "op": e.node_operator(), "reason": clean_message(e.desc())} for e in errs] \
            or [{"node": -1, "name": "", "op": "", "reason": "; ".join(logger.errors()) or "parse failed"}]

    def build_engine(self, model_path: str, profiles: list[dict], compute_capability: str, *,
                     optimization_level: int = 3, workspace_mib: int | None = None,
                     progress: Any = None, stage: str = "build") -> bytes:
        """Parse an ONNX file (strongly typed) and build a serialized engine with all profiles."""
        trt = self.trt
        logger = self.logger()
        builder, network, parser = self.parser(logger)
        with deferred_signals():
            parsed = parser.parse_from_file(model_path)
        if not parsed:
            errs = [parser.get_error(i) for i in range(parser.num_errors)]
            # the parser reports one failure at every level it passes (a node, the If or Loop around it, the graph):
            # each reason once, under the first node that gave it
            detail = "; ".join(unique((f"node {e.node_name() or e.node()} ({e.node_operator()}): " if e.node_operator()
                                       else "") + reason for e, reason in
                                      _first_per_reason((e, clean_message(e.desc())) for e in errs))[:5])
            ops = [e.node_operator() for e in errs if e.node_operator()]
            raise StageError(f"the TensorRT ONNX parser rejected the model: {detail or '; '.join(logger.errors())}",
                             stage=stage, file=model_path, fix=route_around(ops))
        config = builder.create_builder_config()
        cc = self.compute_capability_enum(compute_capability)
        if cc is not None:
            config.num_compute_capabilities = 1
            config.set_compute_capability(cc, 0)
        config.builder_optimization_level = int(optimization_level)
        if workspace_mib:
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_mib) << 20)
        for prof in profiles:
            p = builder.create_optimization_profile()
            for name, r in prof.items():
                p.set_shape(name, tuple(r["min"]), tuple(r["opt"]), tuple(r["max"]))
            config.add_optimization_profile(p)
        config.progress_monitor = progress if progress is not None else signal_monitor(trt)
        with deferred_signals():  # a Ctrl-C or SIGTERM cancels the build at its next step and is delivered after it
            serialized = builder.build_serialized_network(network, config)
        if serialized is None or serialized.nbytes == 0:
            errs = list(dict.fromkeys(logger.errors()))  # the builder's words once (it logs some twice)
            culprit = node_named_in(model_path, errs)
            where = f"node {culprit[0]!r} ({culprit[1]}): " if culprit else ""
            raise StageError(f"TensorRT could not build the engine: {where}{' | '.join(errs[-3:]) or 'no error message'}",
                             stage=stage, file=model_path, fix=builder_fix(errs, [culprit[1]] if culprit else [],
                                                                           model_path))
        return bytes(serialized)

    def engine_validity(self, engine: bytes) -> str:
        runtime = self.runtime()
        if not hasattr(runtime, "get_engine_validity"):
            return "unknown"
        validity, _ = runtime.get_engine_validity(engine)
        return str(validity).rsplit(".", 1)[-1]


def _first_per_reason(pairs):
    """(error, reason) pairs, the first of each reason only."""
    seen: set[str] = set()
    for e, reason in pairs:
        if reason and reason not in seen:
            seen.add(reason)
            yield e, reason


def deadline_monitor(trt, seconds: float) -> Any:
    """A trt.IProgressMonitor that cancels the build once it has run ``seconds`` (``.cancelled`` says whether it did):
    the fallback's bisection builds are bounded in time."""
    import time

    class Deadline(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.until = time.monotonic() + seconds
            self.cancelled = False

        def phase_start(self, phase_name, parent_phase, num_steps):
            pass

        def step_complete(self, phase_name, step):
            if time.monotonic() > self.until:
                self.cancelled = True
            return not self.cancelled and not signal_pending()  # False cancels the build

        def phase_finish(self, phase_name):
            pass

    return Deadline()


def signal_monitor(trt) -> Any:
    """A trt.IProgressMonitor that only cancels the build when a Ctrl-C or SIGTERM waits to be delivered
    (tasks.common.native.deferred_signals)."""
    class Interruptible(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)

        def phase_start(self, phase_name, parent_phase, num_steps):
            pass

        def step_complete(self, phase_name, step):
            return not signal_pending()  # False cancels the build

        def phase_finish(self, phase_name):
            pass

    return Interruptible()


def progress_monitor(trt, console_file) -> Any:
    """A trt.IProgressMonitor that draws the builder's phases as Rich progress bars on console_file."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(file=console_file, stderr=True)
    progress = Progress(TextColumn("  {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=True)

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.tasks: dict[str, Any] = {}
            self.progress = progress

        def phase_start(self, phase_name, parent_phase, num_steps):
            if not self.tasks:
                progress.start()
            depth = 0 if parent_phase is None else 1
            self.tasks[phase_name] = progress.add_task(("  " * depth) + phase_name, total=max(int(num_steps), 1))

        def step_complete(self, phase_name, step):
            t = self.tasks.get(phase_name)
            if t is not None:
                progress.update(t, completed=int(step) + 1)
            return not signal_pending()  # False cancels the build: a Ctrl-C or SIGTERM waits to be delivered

        def phase_finish(self, phase_name):
            t = self.tasks.pop(phase_name, None)
            if t is not None:
                progress.remove_task(t)
            if not self.tasks:
                progress.stop()

    return Monitor()
