"""Loading ONNX files (checked, external data noted, nodes put in order) and fitting a model's IR and opset versions
to the tools that read it: the opset it imports, weights listed as inputs, the newest IR ONNX Runtime loads, a newer
opset."""
from __future__ import annotations

import functools
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from tasks.common.deps import note
from tasks.common.errors import ConfigError, cause
from tasks.graph.edit import toposort


def load_onnx(path: Path, key: str = "model.source", load_external_data: bool = True) -> onnx.ModelProto:
    """Load and check an ONNX file; a corrupt or unreadable file is a ConfigError naming it. Nodes out of topological
    order (ONNX Runtime and TensorRT accept them; the stages need the order) are sorted. Without
    ``load_external_data``, a model that keeps its weights in side files is returned unchecked (its graph only)."""
    try:
        model = onnx.load(str(path), load_external_data=False)
        side = external_data_files(model, Path(path).parent)
        check_protobuf_limit(model, path, key)
        note(*side)  # onnx reads them in C++: the audit hook cannot see it
        if side and load_external_data:
            from onnx.external_data_helper import load_external_data_for_model

            load_external_data_for_model(model, str(Path(path).parent))
    except ConfigError:
        raise
    except Exception as e:  # protobuf DecodeError, missing external data, ...
        raise ConfigError(f"{key}: {path} is not a readable ONNX model ({type(e).__name__}: {cause(e)})",
                          file=str(path), fix="re-export the model, or point the key at the right file") from None
    if not model.graph.node:
        raise ConfigError(f"{key}: {path} has an empty graph", file=str(path), fix="re-export the model")
    if side and not load_external_data:  # the graph alone: checked when it is loaded with its weights (the checker
        return model                     # looks for the weights' files relative to the working directory)
    for first in (True, False):
        try:
            onnx.checker.check_model(model, full_check=False)
            return model
        except Exception as e:
            if first and "topologically sorted" in str(e) and toposort(model.graph):
                continue
            raise ConfigError(f"{key}: {path} fails the ONNX checker: {cause(e)}", file=str(path),
                              fix="re-export the model with a supported opset") from None
    return model


# protobuf's limit on one serialized message: every stage holds the model as one ModelProto and serializes it for
# ONNX Runtime and the TensorRT parser
PROTOBUF_LIMIT = 2**31 - 1


def stored_bytes(model: onnx.ModelProto, base: Path) -> int:
    """The bytes of ``model`` (loaded without its external data) once its external weights are read into it: the
    graph as loaded plus each external tensor's length (the rest of its file where no length is written)."""
    total = model.ByteSize()
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            if "length" in info:
                total += int(info["length"])
            elif (base / info.get("location", "")).is_file():
                total += max(0, (base / info["location"]).stat().st_size - int(info.get("offset") or 0))
    return total


def check_protobuf_limit(model: onnx.ModelProto, path: Path, key: str) -> None:
    """A model that with its weights passes protobuf's 2 GB limit on one message is refused before its weights are
    read, naming its size and what would fit."""
    size = stored_bytes(model, Path(path).parent)
    if size > PROTOBUF_LIMIT:
        raise ConfigError(
            f"{key}: {path} holds {size / 1e9:.2f} GB with its weights, past the 2 GB one ONNX protobuf message can "
            "hold; trtforge's stages hold the model as one message (for ONNX Runtime and the TensorRT parser)",
            file=str(path),
            fix="export the model in parts under 2 GB each (e.g. its encoder and decoder) and build each, or export "
                "its weights in fp16 and build it at precision=fp16")


def external_data_files(model: onnx.ModelProto, base: Path) -> list[Path]:
    """The side files an ONNX model keeps weights in (external data), resolved against its folder."""
    out = set()
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            loc = next((e.value for e in t.external_data if e.key == "location"), None)
            if loc:
                out.add(base / loc)
    return sorted(out)


def opset_of(model: onnx.ModelProto) -> int:
    """The model's opset of the default ONNX domain (0 when it imports none)."""
    return max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)


def drop_initializer_inputs(model: onnx.ModelProto) -> int:
    """Initializers that are also listed as graph inputs become weights only; returns how many inputs were dropped.
    IR < 4 models move to IR 4 (before IR 4 every initializer had to be listed as an input).

    Such an input is a default a caller could override (older exporters list every weight so, at any IR); TensorRT
    and the later stages treat them as weights anyway, and the fp16 converter retypes the initializer but not its
    input entry, which ONNX Runtime then refuses ("initializer ... has element type float16 but usage of initializer in
    graph expects float")."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    keep = [i for i in g.input if i.name not in inits]
    dropped = len(g.input) - len(keep)
    if dropped:
        del g.input[:]
        g.input.extend(keep)
    if model.ir_version < 4:
        model.ir_version = max(4, helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True))
    return dropped


@functools.lru_cache(maxsize=1)
def runtime_max_ir() -> int:
    """The newest ONNX IR version the installed ONNX Runtime loads (probed once with an Identity model)."""
    import onnxruntime as ort

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    so = ort.SessionOptions()
    so.log_severity_level = 4
    for ir in range(onnx.IR_VERSION, 3, -1):
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        m.ir_version = ir
        try:
            ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
            return ir
        except Exception:  # noqa: BLE001 - too new for this runtime: try the next older IR
            continue
    return 3


def lower_ir(model: onnx.ModelProto) -> str | None:
    """A model written with a newer IR than ONNX Runtime loads (onnx 1.23's make_model writes IR 14; ONNX Runtime 1.31
    loads <= 13) gets the newest IR the runtime loads, when its opsets allow it (onnx.helper.VERSION_TABLE): the same
    graph. Returns the note, or None when nothing changed; a ConfigError when the opsets need the newer IR."""
    top = runtime_max_ir()
    if model.ir_version <= top:
        return None
    need = helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    if need > top:
        opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in model.opset_import)
        raise ConfigError(f"the model needs ONNX IR {need} for its opsets ({opsets}), newer than the IR {top} the "
                          "installed ONNX Runtime loads", fix="export the model at an older opset, or upgrade onnxruntime")
    old, model.ir_version = model.ir_version, top
    return f"IR {old} -> {top}: the newest the installed ONNX Runtime loads (its opsets need IR {need})"


def with_opset(model: onnx.ModelProto, opset: int) -> tuple[onnx.ModelProto, str]:
    """``model`` at default-domain ``opset`` (newer): onnx's version converter, or, where it cannot convert an op,
    the opset relabelled (the ops used mean the same in both). Returns the model and how it was done."""
    try:
        from onnx import version_converter

        return version_converter.convert_version(model, opset), "version_converter"
    except Exception as e:  # noqa: BLE001 - fall back to relabelling the default domain
        for o in model.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = opset
        return model, f"relabelled ({type(e).__name__}: {str(e)[:120]})"
