"""Stage 1, export: a model source (ONNX file, pkg://, or a torch factory) to one sanitized fp32 ONNX file."""
from __future__ import annotations

import importlib
import importlib.util
import time
from pathlib import Path
from typing import Any

from tasks.common.errors import ConfigError, StageError, cause
from tasks.graph.models import graph_io, resolve_source
from tasks.graph.models import save_onnx
from tasks.common.usermodules import add_import_paths, fresh_user_modules
from tasks.common.util import StageResult, sha256_file, write_json

def source_fingerprint(model_cfg: Any, search: list[Path] | None = None) -> dict:
    """What the export depends on (for the content-addressed cache) without doing the export."""
    if model_cfg["format"] == "onnx":
        path = resolve_source(model_cfg["source"], search=search)
        return {"source_sha256": sha256_file(path)}
    if model_cfg["format"] == "paddle":
        from tasks.sources.paddle import paddle_files

        path = resolve_source(model_cfg["source"], search=search)
        return {"source_sha256": sha256_file(path), "params_sha256": sha256_file(paddle_files(path))}
    module_name = str(model_cfg["factory"]).partition(":")[0]
    add_import_paths(search)
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        spec = None
    origin = spec.origin if spec else None
    return {"factory": model_cfg["factory"], "module_sha256": sha256_file(origin) if origin and Path(origin).is_file() else None}


def onnx_from_model(model_cfg: Any, profiles: list[dict], out_path: Path, search: list[Path] | None = None,
                    cache_root: Path | None = None) -> StageResult:
    """Export or pass through, then sanitize; writes out_path (fp32 ONNX). `cache_root` keeps Paddle conversions."""
    from tasks.graph.fold import fold_for_profiles
    from tasks.graph.load import load_onnx, opset_of
    from tasks.graph.specialise import specialise
    import onnx

    from tasks.prequant.detect import quantization_of
    from tasks.prequant.rewrite import trt_from_prequantized
    from tasks.prequant.weight_only import dequantize_cast_weights, has_cast_weights, weight_only_note

    out_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if model_cfg["format"] == "onnx":
        src = resolve_source(model_cfg["source"], search=search)
        model = load_onnx(src)
        how = "onnx passthrough"
    elif model_cfg["format"] == "torch":
        raw = out_path.with_name("torch_export.onnx")
        how = onnx_from_torch(model_cfg, profiles, raw, search=search)
        model = load_onnx(raw, key="model.factory")
    elif model_cfg["format"] == "paddle":
        from tasks.sources.paddle import converted_onnx

        src = resolve_source(model_cfg["source"], search=search)
        raw, how = converted_onnx(src, cache_root or out_path.parent / "paddle")
        model = load_onnx(raw)
    else:
        raise ConfigError(f"model.format={model_cfg['format']!r} is not supported", fix="use onnx, torch or paddle")
    model, notes = sanitize(model)
    files, metrics, details = {"onnx": out_path}, {}, {}
    constants = dict(model_cfg.get("constants") or {})
    if constants:  # bound inputs, and the control flow they decide folded away
        details["constants"] = specialise(model, constants, profiles)
        notes += details["constants"]
        del model.graph.value_info[:]  # inferred before the folds: stale
        model = infer_shapes(model, notes)
    folded = fold_for_profiles(model, profiles)  # convolutions whose shapes only the profile reveals
    if folded:
        details["folded"] = folded
        notes += folded
    shipped = None
    if has_cast_weights(model):  # weight-only quantization written as Cast -> Mul: TensorRT takes it as DQ
        shipped = onnx.ModelProto()
        shipped.CopyFrom(model)
        found = dequantize_cast_weights(model)
        notes.append(weight_only_note(found))
        if found["weight_only"]:
            details["weight_only"] = found
        else:  # nothing rewritten: the graph is the model as shipped
            shipped = None
    quant = quantization_of(model)
    if any(quant.values()) or shipped is not None:  # the model as shipped is the reference; TensorRT gets what it can take
        files["reference"] = out_path.with_name("shipped.onnx")
        save_onnx(shipped if shipped is not None else model, files["reference"])
    if any(quant.values()):
        model, stats = trt_from_prequantized(model, bool(model_cfg.get("dequantize_dynamic")),
                                             model_cfg.get("asymmetric") or "exact")
        details["prequantized"] = {**quant, **stats}
        files["prequant"] = write_json(out_path.with_name("prequant.json"), details["prequantized"])  # per tensor
        if stats["computes"] or stats["dynamic_left"]:  # a weight-only model computes float: no quantized layers
            metrics.update(quantized_layers=stats["quantized_layers"], fallback_layers=stats["fallback_layers"])
    save_onnx(model, out_path)
    ins, outs = graph_io(model)
    return StageResult(
        files=files,
        metrics={"export_nodes": len(model.graph.node), "opset": opset_of(model), "export_seconds": time.perf_counter() - t0,
                 **metrics},
        details={"how": how, "sanitize": notes, "inputs": [vars(t) for t in ins], "outputs": [vars(t) for t in outs],
                 **details},
    )


def constants_text(constants: dict) -> str:
    """model.constants as words: "sr=16000, ..."."""
    return ", ".join(f"{k}={v}" for k, v in constants.items())


def sanitize(model) -> tuple[Any, list[str]]:
    """Make a graph TensorRT and the later stages can rely on.

    - initializers also listed as graph inputs (every legacy IR < 4 model, older exporters at any IR) become weights
      only, and IR < 4 models move to IR 4;
      models newer than the installed ONNX Runtime loads (IR 14 from onnx 1.23's defaults) move down to its newest IR;
    - Constant nodes become initializers (constant folding of what is stored as nodes);
    - symbolic dims that repeat inside one input (PP-OCR cls names H and W both '?') get distinct names,
      because TensorRT reads a shared name as one dimension and refuses non-square profiles;
    - shape inference fills in value_info for the later precision passes.
    """
    from tasks.graph.fold import fold_constants
    from tasks.graph.load import drop_initializer_inputs, lower_ir

    notes: list[str] = []
    g = model.graph
    ir = model.ir_version
    dropped = drop_initializer_inputs(model)
    if dropped:
        moved = f"IR {ir} -> {model.ir_version}: " if model.ir_version != ir else ""
        notes.append(f"{moved}{dropped} initializers no longer listed as graph inputs (weights, as TensorRT takes them)")
    lowered = lower_ir(model)
    if lowered:
        notes.append(lowered)
    folded = fold_constants(g)
    if folded:
        notes.append(f"{folded} Constant nodes folded into initializers")
    inits = {i.name for i in g.initializer}
    for inp in g.input:
        if inp.name in inits:
            continue
        dims = inp.type.tensor_type.shape.dim
        names = [d.dim_param for d in dims if d.HasField("dim_param")]
        for i, d in enumerate(dims):
            unknown = (d.HasField("dim_value") and d.dim_value <= 0) or (not d.HasField("dim_value") and not d.dim_param)
            repeated = d.HasField("dim_param") and (d.dim_param in ("?", "") or names.count(d.dim_param) > 1)
            if unknown or repeated:
                old = d.dim_param if d.dim_param else (str(d.dim_value) if d.HasField("dim_value") else "unnamed")
                d.dim_param = f"{inp.name}_dim{i}"
                notes.append(f"input {inp.name!r} dim {i}: {old!r} renamed {d.dim_param!r} (distinct name)")
    return infer_shapes(model, notes), notes


def infer_shapes(model, notes: list[str]):
    """Shape inference fills in value_info for the later precision passes."""
    import onnx

    try:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as e:  # shape inference is a help, not a requirement
        notes.append(f"shape inference skipped: {str(e)[:120]}")
        return model


def onnx_from_torch(model_cfg: Any, profiles: list[dict], out_path: Path, search: list[Path] | None = None) -> str:
    """torch.nn.Module from a zero-argument factory -> ONNX, dims that vary in the profiles exported as dynamic axes."""
    try:
        import torch
    except ImportError:
        raise ConfigError("model.format=torch needs PyTorch, which is not installed",
                          fix="pip install 'trtforge[torch]' (torch==2.13.0)") from None
    factory = str(model_cfg["factory"] or "")
    mod_name, _, fn_name = factory.partition(":")
    if not mod_name or not fn_name:
        raise ConfigError(f"model.factory={factory!r} is not 'module.path:callable'", fix="e.g. model.factory=mypkg.models:make_net")
    add_import_paths(search)
    fresh_user_modules(mod_name, search)
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"model.factory={factory!r} cannot be imported: {e}",
                          fix="make the module importable (installed, or in the working directory)") from None
    try:
        module = fn()
    except Exception as e:
        raise StageError(f"model.factory={factory!r} raised {type(e).__name__}: {e}", stage="export") from e
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"model.factory={factory!r} returned {type(module).__name__}, not a torch.nn.Module",
                          fix="return an nn.Module from the factory")
    module.eval()
    specs = dict(model_cfg["inputs"])
    if not specs:
        raise ConfigError("model.inputs is empty for format=torch", fix="map each forward() argument to {shape: [...], dtype: float32}")
    gen = torch.Generator().manual_seed(0)
    args = []
    for name, spec in specs.items():
        dtype = getattr(torch, str(spec["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"model.inputs.{name}.dtype={spec['dtype']!r} is not a torch dtype", fix="e.g. float32, int64")
        shape = [int(d) for d in spec["shape"]]
        args.append(torch.rand(shape, generator=gen).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype))
    dynamic_axes = {}
    for prof in profiles:
        for name, r in prof.items():
            for i, (lo, hi) in enumerate(zip(r["min"], r["max"])):
                if lo != hi:
                    dynamic_axes.setdefault(name, {})[i] = f"{name}_dim{i}"
    names = list(specs)
    errors = []
    for dynamo in (True, False):
        try:
            kwargs = dict(input_names=names, opset_version=int(model_cfg["opset"]), dynamo=dynamo)
            if dynamo:  # the dynamo exporter takes dynamic_shapes (per forward() argument, in order)
                kwargs["external_data"] = False
                if dynamic_axes:
                    kwargs["dynamic_shapes"] = tuple({i: torch.export.Dim.DYNAMIC for i in dynamic_axes.get(n, {})} or None
                                                     for n in names)
            else:
                kwargs["dynamic_axes"] = dynamic_axes or None
            from tasks.common.native import quiet_native

            with torch.no_grad(), quiet_native():  # the exporter's progress lines and warnings
                torch.onnx.export(module, tuple(args), str(out_path), **kwargs)
            return f"torch.onnx.export(dynamo={dynamo})"
        except Exception as e:  # fall back to the legacy exporter
            errors.append(f"dynamo={dynamo}: {type(e).__name__}: {cause(e)}")
    raise StageError("torch.onnx.export failed: " + " | ".join(errors), stage="export", file=factory,
                     fix="check that forward() runs on the example inputs in model.inputs")
