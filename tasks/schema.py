"""Typed configuration schema. Pure dataclasses: Hydra registers them in flows/config.py.

`MISSING` marks required keys; OmegaConf's struct mode (via the ConfigStore) rejects unknown keys. A key with a fixed
set of values declares them once, here, in its field's metadata (`one_of`); preflight checks them (`choices_of`). They
stay `str` fields: OmegaConf 2.3 does not take Literal, and an Enum field would hand Enum members (not strings) to the
cache keys, the recorded parameters and every message that prints the value.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, get_type_hints

from omegaconf import MISSING

STAGES = ("export", "partition", "build", "calibrate", "validate", "benchmark")
PRECISIONS = ("fp32", "fp16", "int8", "fp8")
MODEL_FORMATS = ("onnx", "torch", "paddle")
REFERENCES = ("shipped", "dequantized")
ASYMMETRIC_MODES = ("exact", "int8", "float")
CALIBRATION_METHODS = ("entropy", "minmax", "percentile")
ACCURACY_METRICS = ("cosine", "allclose", "top1")  # built in; any other value names a module:function
SYNTHETIC_IMAGES = ("synthetic:text",)
CHANNEL_ORDERS = ("BGR", "RGB", "GRAY")  # model.images.channel_order (any case): GRAY is one channel, ITU-R 601 luma
IMAGE_LAYOUTS = ("NCHW", "NHWC")


def one_of(default: Any, choices: tuple[str, ...]) -> Any:
    """A str field whose value is one of ``choices`` (checked by preflight, which names them in its message)."""
    return field(default=default, metadata={"choices": choices})


def choices_of(key: str) -> tuple[str, ...]:
    """The values declared for a dotted config key (e.g. 'model.format'); () when it declares none."""
    node: Any = Config
    *path, name = key.split(".")
    for part in path:
        node = get_type_hints(node)[part]
        node = next((a for a in getattr(node, "__args__", ()) if a is not type(None)), node)  # Optional[X] -> X
    return next((f.metadata.get("choices", ()) for f in fields(node) if f.name == name), ())


@dataclass
class DimRange:
    min: List[int] = MISSING
    opt: List[int] = MISSING
    max: List[int] = MISSING


@dataclass
class TensorSpec:
    shape: List[int] = MISSING
    dtype: str = "float32"


@dataclass
class ImageRecipe:
    """How to turn images into model inputs (PP-OCR style preprocessing)."""

    source: str = MISSING  # a folder of images, or one of SYNTHETIC_IMAGES (synthetic:text: text pages rendered with PIL)
    input: str = "x"  # the model input the images feed
    height: int = 640
    width: int = 640
    channel_order: str = "BGR"  # one of CHANNEL_ORDERS (checked by preflight, in any case)
    scale: float = 0.00392156862745098  # 1/255
    mean: List[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # per channel (GRAY: one value, or equal ones)
    std: List[float] = field(default_factory=lambda: [1.0, 1.0, 1.0])
    layout: str = "NCHW"  # one of IMAGE_LAYOUTS


@dataclass
class TrafficConfig:
    """The shapes a service sees (tasks/data/traffic.py): the profiles are proposed from them, data drawn from their mix."""

    # a .jsonl of request shapes ({"x": [1, 3, 736, 1312], "count": 42}) or a folder of .npz/.npy; None: no traffic
    source: Optional[str] = None
    profiles: Optional[int] = None  # how many profiles; None: trtforge chooses (and says why)
    coverage: float = 0.999  # share of requests the profiles must cover; rarer extremes are left out and listed
    max_activation_mib: Optional[float] = None  # no profile's max may need more activation memory (estimated)


@dataclass
class ModelConfig:
    name: str = MISSING
    format: str = one_of("onnx", MODEL_FORMATS)
    source: Optional[str] = None  # path or pkg://PACKAGE/REL/PATH (onnx: the .onnx; paddle: the .pdmodel or .json)
    factory: Optional[str] = None  # "module.path:callable" (format torch)
    inputs: Dict[str, TensorSpec] = field(default_factory=dict)  # torch: forward() args in order
    opset: int = 18  # torch export opset (the dynamo exporter's lowest)
    profiles: List[Dict[str, DimRange]] = field(default_factory=list)
    # per input, per dim: drawn shapes are multiples of this (PP-OCR det needs H and W divisible by 32)
    shape_multiple: Dict[str, List[int]] = field(default_factory=dict)
    images: Optional[ImageRecipe] = None  # real-looking inputs for calibration/validation
    # a model quantized dynamically (DynamicQuantizeLinear, ConvInteger, MatMulInteger): those parts run in ONNX Runtime,
    # or with true become float MatMul/Conv on the dequantized weights (then TensorRT can take them)
    dequantize_dynamic: bool = False
    # what a model that arrives quantized is validated against: "shipped" (the model as shipped, in ONNX Runtime) or,
    # with dequantize_dynamic=true, "dequantized" (its dequantized float form: what the engine computes)
    reference: str = one_of("shipped", REFERENCES)
    # a model that arrives with asymmetric Q/DQ (uint8 zero point != 128, int8 with a zero point; TensorRT takes no zero
    # point): exact keeps the model's own rounding as a shifted int8 pair (int8 layers where the shift folds into a
    # bias); int8 requantizes the pairs feeding Conv/MatMul/Gemm to symmetric int8 over their range (faster, another
    # rounding); float runs them in float
    asymmetric: str = one_of("exact", ASYMMETRIC_MODES)
    # inputs bound to a fixed value (e.g. {sr: 16000}): export makes them initializers and folds the If nodes they
    # decide; they are no model inputs any more (no profile, no data), and the engine is specialised for them
    constants: Dict[str, Any] = field(default_factory=dict)
    # shape profiles from real traffic (model.profiles, when also given, wins and is checked against it)
    traffic: TrafficConfig = field(default_factory=TrafficConfig)


@dataclass
class TargetConfig:
    name: str = MISSING  # sm_86
    compute_capability: str = MISSING  # "8.6"
    architecture: str = MISSING  # Ampere
    gpus: List[str] = field(default_factory=list)
    precisions: List[str] = field(default_factory=lambda: ["fp32"])
    backend: str = "tensorrt_rtx"  # tensorrt_rtx (CPU-only AOT) | tensorrt (Enterprise, on a GPU of this arch)
    supported: bool = True
    jetson: bool = False
    note: str = ""


@dataclass
class PrecisionConfig:
    name: str = one_of(MISSING, PRECISIONS)
    quantized: bool = False  # int8/fp8: explicit Q/DQ from calibration
    baseline: str = "fp32"  # precision of the baseline engine that build makes
    min_compute_capability: str = "0.0"


@dataclass
class CalibrationConfig:
    # minmax with symmetric ranges is amax; None: entropy for int8, minmax for fp8
    method: Optional[str] = one_of(None, CALIBRATION_METHODS)
    data: Optional[str] = None  # .npz/.npy file or folder of them, one array per input name
    samples: int = 16
    # the share of the allowed error above accuracy.min_cosine the search aims at, so the budget still holds when
    # validate checks other samples; None: derived from the held-out samples, the candidates judged and validation's
    # samples (tasks/accuracy/budget.py; fp16's search: FIXED_MARGIN)
    budget_margin: Optional[float] = None
    search: bool = True  # keep sensitive layers in higher precision until accuracy.min_cosine holds (else quantize all)


@dataclass
class ValidationConfig:
    data: Optional[str] = None
    samples: int = 4  # with no validation data: draws (new content each) besides the min, opt and max shapes
    seed: int = 0
    engine: bool = True  # also run the engine where a supported GPU exists
    # a .npy (or an .npz of one array) with one label per sample of validation.data, in its order: given to an
    # accuracy.metric=module:function as the keyword labels= (the labels of that batch's samples)
    labels: Optional[str] = None


@dataclass
class AccuracyConfig:
    """The metric that gates validate, the accuracy search and the scheduled rebuild (tasks/accuracy/metric.py)."""

    # one of ACCURACY_METRICS or module:function (the user's, in the working dir or the config dir, called per batch
    # as fn(outputs, references, feeds) -> (score, passed))
    metric: str = "cosine"
    min_cosine: float = 0.99  # cosine: each output's pooled cosine to the reference reaches this
    atol: float = 1e-5  # allclose: |candidate - reference| <= atol + rtol * |reference| (Polygraphy's defaults)
    rtol: float = 1e-5
    outputs: Dict[str, Dict[str, float]] = field(default_factory=dict)  # allclose, per output: {atol, rtol}
    min_within: float = 1.0  # allclose: share of each output's elements within tolerance
    min_agreement: float = 0.99  # top1: share of rows whose argmax (last axis) agrees with the reference
    greater_is_better: bool = True  # module:function: which way its score is better (the worst is reported)
    # outputs from a final Softmax/Sigmoid/LogSoftmax are also judged on their logits (always reported); true: the
    # logits gate too (cosine and allclose)
    gate_logits: bool = False


@dataclass
class PartitionConfig:
    min_subgraph_size: int = 3
    exclude_ops: List[str] = field(default_factory=list)
    strict: bool = False
    # TensorRT can parse If/Loop/Scan and still fail to build them: then run them in ONNX Runtime and re-plan
    control_flow_fallback: bool = True
    # any other segment TensorRT cannot build: find the failing node by bisection (Polygraphy's debug reduce), run it
    # in ONNX Runtime and re-plan (partition.strict=true or false: fail instead)
    build_fallback: bool = True
    # set by that fallback (node index -> the builder's words), not by users: nodes that run in ONNX Runtime
    exclude_nodes: Dict[str, str] = field(default_factory=dict)
    # ops from other domains (com.microsoft contrib ops, custom ops) run in ONNX Runtime: TensorRT's parser reads
    # them by name only, which is right only when a same-named ONNX op means the same. Domains listed here
    # (TensorRT plugin namespaces) are left to the parser's verdict.
    trt_domains: List[str] = field(default_factory=lambda: ["trt", "trt.plugins"])


@dataclass
class BuildConfig:
    optimization_level: int = 3
    workspace_mib: Optional[int] = None
    # fp16 (and int8/fp8's fp16 remainder): a node whose values on the data exceed this magnitude stays fp32
    fp16_data_max: float = 32768.0


@dataclass
class BenchmarkConfig:
    warmup: int = 3
    iterations: int = 10
    repeats: int = 3
    threads: int = 0  # ONNX Runtime intra-op threads; 0 = its default
    cuda_graph: bool = False  # engines on a GPU: replay each run as a CUDA graph


@dataclass
class StagesConfig:
    validate: bool = True
    benchmark: bool = True


@dataclass
class Config:
    model: ModelConfig = MISSING
    target: TargetConfig = MISSING
    precision: PrecisionConfig = MISSING
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    accuracy: AccuracyConfig = field(default_factory=AccuracyConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    build: BuildConfig = field(default_factory=BuildConfig)
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    stages: StagesConfig = field(default_factory=StagesConfig)
    cache_dir: str = ".trtforge/cache"
    out_dir: str = "out"
    summary_out: Optional[str] = None
    # the most resident memory (MiB) a build's processes may use; None: 75% of what the host has available at its start
    memory_budget_mib: Optional[int] = None
    experiment: str = "trtforge"
    seed: int = 0
