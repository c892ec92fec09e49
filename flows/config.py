"""Hydra configuration: the typed schema in the ConfigStore, composition with friendly errors, and the
whole-config check that runs before the first heavy step."""
from __future__ import annotations

import difflib
import re
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from tasks import schema
from tasks.common import ConfigError

if TYPE_CHECKING:
    from flows.context import BuildInputs

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ("model", "target", "precision")


def register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="trtforge_schema", node=schema.Config)


def options(group: str, config_dir: str | None = None) -> list[str]:
    dirs = [CONF_DIR] + ([Path(config_dir)] if config_dir else [])
    names = {p.stem for d in dirs for p in (d / group).glob("*.yaml")}
    return sorted(names, key=lambda n: (len(n), n)) if group == "target" else sorted(names)


def _schema_walk(parts: list[str]):
    """Along ``parts`` of a key: (the parts so far, the dataclass the schema types there, whether it types it as an
    optional block), up to the first part that is not a field holding a dataclass."""
    import typing

    node: Any = schema.Config
    for k, part in enumerate(parts):
        tp = typing.get_type_hints(node).get(part)
        args = typing.get_args(tp)
        optional = bool(args) and type(None) in args
        if optional:
            tp = next(a for a in args if a is not type(None))
        if not is_dataclass(tp):
            return
        yield parts[:k + 1], tp, optional
        node = tp


def _schema_keys(full_key: str) -> list[str]:
    """Valid keys at the level of full_key (e.g. 'model.profile' -> the fields of ModelConfig)."""
    parts = full_key.split(".")[:-1]
    walked = list(_schema_walk(parts))
    if len(walked) < len(parts):
        return []
    return [f.name for f in fields(walked[-1][1] if walked else schema.Config)]


def _optional_section(key: str) -> str | None:
    """The section on ``key``'s path that the schema types as an optional block (e.g. 'model.images' for
    'model.images.source'), None where there is none."""
    return next((".".join(p) for p, _, optional in _schema_walk(key.lstrip("+").split(".")) if optional), None)


def _suggest(word: str, candidates: list[str]) -> str:
    m = difflib.get_close_matches(word, candidates, n=1, cutoff=0.5)
    return f"did you mean {m[0]!r}?" if m else f"valid keys: {', '.join(candidates)}"


def translate(e: Exception, config_dir: str | None, overrides: list[str] = ()) -> ConfigError:
    """Hydra/OmegaConf composition errors -> one short message with the key, the value and the fix."""
    text = str(e)
    cause = e.__cause__ or e.__context__
    full = text + ("\n" + str(cause) if cause else "")
    if "NoneType" in full:  # an override into an optional block the config leaves unset (OmegaConf cannot merge into it)
        for o in overrides:
            key = o.split("=", 1)[0]
            section = _optional_section(key)
            if section is not None:
                where = "the model's YAML" if section.startswith("model.") else "a YAML of your --config-dir"
                return ConfigError(f"{key}: {section} is not set in this config, and an override cannot set it or a "
                                   "key inside it", fix=f"write the whole {section.rsplit('.', 1)[-1]}: {{...}} "
                                                        f"block into {where} (docs/models.md)")
    m = re.search(r"Could not find '(\w+)/([^']+)'", full)
    if m:
        group, value = m.groups()
        valid = options(group, config_dir)
        near = difflib.get_close_matches(value, valid, n=1)
        hint = f"did you mean {group}={near[0]}? " if near else ""
        extra = f"; or add {group}/{value}.yaml to your --config-dir" if group == "model" else ""
        return ConfigError(f"{group}={value} is not a known {group}", fix=f"{hint}valid {group}s: {', '.join(valid)}{extra}")
    m = re.search(r"full_key: (\S+)", full)
    key_m = re.search(r"Key '([^']+)' (?:is )?not in (?:struct|'(\w+)')", full)
    if key_m:
        bad = key_m.group(1)
        full_key = m.group(1) if m else bad
        if "." not in full_key and "Could not override" in full:
            ov = re.search(r"Could not override '([^']+)'", full)
            full_key = ov.group(1) if ov else full_key
        append = re.search(r"To append to your config use (.+)", full)
        if append and "." in full_key and not _schema_keys(full_key):  # a free-form map (model.shape_multiple)
            return ConfigError(f"{full_key.rsplit('.', 1)[0]} has no entry {bad!r} yet, and a plain override only "
                               "replaces existing entries", fix=f"add it with a leading '+': {append.group(1)}")
        valid = _schema_keys(full_key) or [f.name for f in fields(schema.Config)] + list(GROUPS)
        where = f" in {full_key.rsplit('.', 1)[0]}" if "." in full_key else ""
        src = ""
        fm = re.search(r"In '([^']+)'", full)
        if fm:
            src = f" (from {fm.group(1)}.yaml)"
        return ConfigError(f"unknown config key {full_key!r}{where}{src}", fix=_suggest(full_key.rsplit(".", 1)[-1], valid))
    m2 = re.search(r"Value '([^']*)' (?:of type '\w+' )?could not be converted to (\w+)", full)
    if m2 and m:
        return ConfigError(f"{m.group(1)}={m2.group(1)!r} is not a valid {m2.group(2)}", fix=f"give {m.group(1)} a {m2.group(2)} value")
    m3 = re.search(r"Missing mandatory value: (\S+)", full)
    if m3:
        return ConfigError(f"{m3.group(1)} is required but not set", fix=f"set {m3.group(1)}=... in the YAML or on the command line")
    first = "; ".join(line.strip() for line in full.splitlines() if line.strip())[:400]
    return ConfigError(f"invalid configuration: {first}", fix="check the override syntax: key=value, group=option")


def compose_config(overrides: list[str], config_dir: str | None = None) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    ov = list(overrides)
    if config_dir:
        d = Path(config_dir).expanduser().resolve()
        if not d.is_dir():
            raise ConfigError(f"--config-dir {config_dir!r} is not a folder", fix="give a folder holding model/NAME.yaml etc.")
        ov.append(f"hydra.searchpath=[file://{d}]")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="trtforge"):
            cfg = compose(config_name="config", overrides=ov)
            OmegaConf.resolve(cfg)
            cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
            _ = OmegaConf.to_container(cfg, throw_on_missing=True)
    except ConfigError:
        raise
    except Exception as e:
        raise translate(e, config_dir, overrides) from None
    finally:
        GlobalHydra.instance().clear()
    return cfg


def config_dir_search(config_dir: str | None) -> list[Path]:
    """Relative model sources may be relative to the user's config dir."""
    return [Path(config_dir).expanduser().resolve()] if config_dir else []


def _cc(v: str) -> tuple[int, int]:
    major, _, minor = str(v).partition(".")
    return int(major), int(minor or 0)


def _in_words(values: tuple[str, ...]) -> str:
    """'a, b or c'."""
    return f"{', '.join(values[:-1])} or {values[-1]}" if len(values) > 1 else values[0]


def check_choice(cfg: DictConfig, key: str, verdict: str = "is unknown") -> None:
    """A key with declared values (tasks/schema.py `one_of`) holds one of them (or None, its default)."""
    value = OmegaConf.select(cfg, key)
    if value is not None and value not in schema.choices_of(key):
        raise ConfigError(f"{key}={value!r} {verdict}", fix=f"use {_in_words(schema.choices_of(key))}")


def preflight(cfg: DictConfig, config_dir: str | None = None, budget: Any = None) -> BuildInputs:
    """Check the whole config before any heavy step, and split the data: what the stages need (model io, profiles,
    shape rules, backend, the calibration / search / validation sets). A model that cannot be built within the memory
    ``budget`` (tasks.common.memory.Budget; default: the build's, from memory_budget_mib) is refused here."""
    from flows.context import BuildInputs  # (imported here: the up-to-date check before preflight stays light)
    from tasks.common import budget_from_config
    from tasks.common.memory import resident_bytes
    from tasks.trt import backend_for_target

    check_settings(cfg, config_dir)
    budget = budget if budget is not None else budget_from_config(cfg.memory_budget_mib)
    resident = resident_bytes()  # before the model is read: what the build holds through every stage
    m, t, p, cal = cfg.model, cfg.target, cfg.precision, cfg.calibration
    search = config_dir_search(config_dir)
    backend = backend_for_target(t.name, t.backend, t.compute_capability, t.architecture, t.note)
    model, inputs, outputs, prequant = model_io(cfg, search, budget)
    inputs = bind_constants(cfg, inputs)
    check_outputs(cfg, outputs)
    calibrates = calibrates_of(cfg, prequant)
    if calibrates and not cal.data and m.images is None:
        why = " (model.dequantize_dynamic=true makes the model float: it is calibrated anew)" if prequant else ""
        raise ConfigError(f"precision={p.name} needs calibration data{why}: calibration.data is not set and model "
                          f"{m.name} has no images recipe",
                          fix="set calibration.data=path/to/samples.npz (or a folder of .npz/.npy, one array per input name)")
    if m.images is not None and m.images.input not in [i.name for i in inputs]:
        raise ConfigError(f"model.images.input={m.images.input!r} is not an input of the model",
                          fix=f"use one of {[i.name for i in inputs]}")
    if m.images is not None:
        check_image_input(m.images, inputs)
    profiles, rules, traffic = shapes_of(cfg, model, inputs, search)
    data, user = data_of(cfg, inputs, profiles, rules, calibrates)
    check_labels(cfg, user)
    estimate, warnings = (memory_fit(model, model_path(cfg, search), profiles, inputs, data, traffic, budget, resident)
                          if model is not None else (None, []))
    return BuildInputs(backend=backend, inputs=inputs, outputs=outputs, profiles=profiles, rules=rules, search=search,
                       prequantized=prequant, data=data, traffic=traffic, memory_estimate=estimate, warnings=warnings,
                       resident=resident)


def calibrates_of(cfg: DictConfig, prequant: dict | None) -> bool:
    """Whether the build calibrates: a quantized precision of a float model, or of a dynamically quantized one that
    model.dequantize_dynamic=true turns into float (``prequant``: the quantization the model arrived with)."""
    if not cfg.precision.quantized:
        return False
    return not prequant or bool(cfg.model.dequantize_dynamic and prequant.get("dynamic"))


def memory_fit(model: Any, path: Path, profiles: list, inputs: list, data: Any, traffic: Any,
               budget: Any, resident: int, key: str = "model.source") -> tuple[Any, list[str]]:
    """The lower bound of the build's peak (tasks.common.memory.Estimate) checked against ``budget``: refused (exit 2)
    when over it; (the estimate, [a warning when it is near]). ``resident``: what the build's processes held before the
    model was read (held through every stage: its libraries; the graph preflight reads is counted with the weights).
    The largest step at the profiles' max shapes counts when validate runs the model at them (generated inputs: each
    profile's min, opt and max). ``key``: the config key naming the model."""
    from tasks.common.memory import fit_check
    from tasks.graph.footprint import estimate_of

    at_max = data.validation is not None and data.validation.kind != "file" and traffic is None
    static = {i.name: i.shape for i in inputs if all(isinstance(d, int) and d > 0 for d in i.shape)}
    estimate = estimate_of(path, model, resident, profiles if at_max else None, static, key)
    warning = fit_check(estimate, budget, file=str(path))
    return estimate, [warning] if warning else []


def after_export(cfg: DictConfig, inputs: BuildInputs, onnx_path: Path, budget: Any) -> BuildInputs:
    """A torch model's graph, which exists only after export: the memory check preflight does for an ONNX model
    (refused as bad input, exit 2, before any heavy stage) and what the graph shows its inputs mean, with the data
    split again so its random sets are drawn in those domains and say so. Returns the updated inputs."""
    import dataclasses

    from tasks.graph import load_onnx
    from tasks.graph.meaning import input_domains

    model = load_onnx(onnx_path, key="the exported model")
    domains = input_domains(model, [i.name for i in inputs.inputs])
    data = inputs.data
    if domains:
        rules = dataclasses.replace(inputs.rules, domains=domains)
        calibrates = calibrates_of(cfg, inputs.prequantized)
        data = data_of(cfg, inputs.inputs, inputs.profiles, rules, calibrates)[0]
        inputs = dataclasses.replace(inputs, rules=rules)
    estimate, warnings = memory_fit(model, Path(onnx_path), inputs.profiles, inputs.inputs, data, inputs.traffic, budget,
                                    inputs.resident, "model.factory")
    return dataclasses.replace(inputs, data=data, memory_estimate=estimate, warnings=inputs.warnings + warnings)


def model_path(cfg: DictConfig, search: list[Path]) -> Path:
    """The ONNX file preflight reads (a Paddle model's conversion)."""
    from tasks.graph import resolve_source

    src = resolve_source(cfg.model.source, search=search)
    if cfg.model.format == "paddle":
        from tasks.sources import converted_onnx
        src = converted_onnx(src, paddle_cache(cfg))[0]
    return Path(src)


def check_settings(cfg: DictConfig, config_dir: str | None) -> None:
    """The checks the config alone decides (names, target and precision, declared values, ranges), before the model is
    read."""
    from tasks.graph import check_safe_name

    m, t, p = cfg.model, cfg.target, cfg.precision
    check_safe_name("model.name", m.name)
    check_safe_name("target.name", t.name)
    check_safe_name("precision.name", p.name)
    targets = [n for n in options("target", config_dir) if n]
    if not t.supported:
        ok = ", ".join(n for n in targets if n not in ("sm_20", "sm_30"))
        raise ConfigError(f"target={t.name} is not supported: {t.note}", fix=f"pick a supported target: {ok}")
    precisions = schema.choices_of("precision.name")
    if p.name not in precisions:
        raise ConfigError(f"precision={p.name} is unknown", fix=f"use one of {', '.join(precisions)}")
    if p.name not in t.precisions:
        raise ConfigError(f"precision={p.name} is not supported by target={t.name} ({t.architecture}; it supports "
                          f"{', '.join(t.precisions)})",
                          fix=f"pick one of {', '.join(t.precisions)}, or a newer target"
                          + (" (fp8 needs sm_89 or newer)" if p.name == "fp8" else ""))
    if _cc(t.compute_capability) < _cc(p.min_compute_capability):
        raise ConfigError(f"precision={p.name} needs compute capability {p.min_compute_capability} or newer; target={t.name} is "
                          f"{t.compute_capability}", fix="use target=sm_89 or newer, or precision=int8/fp16")
    check_choice(cfg, "model.format", "is not supported")
    check_choice(cfg, "model.asymmetric")
    check_choice(cfg, "model.reference")
    if m.reference == "dequantized" and not m.dequantize_dynamic:
        raise ConfigError("model.reference=dequantized names the dequantized float form of a dynamically quantized "
                          "model, which only model.dequantize_dynamic=true builds",
                          fix="set model.dequantize_dynamic=true too, or model.reference=shipped")
    check_choice(cfg, "calibration.method")
    check_numbers(cfg, config_dir)
    if m.images is not None:
        src = m.images.source
        if not src.startswith("synthetic:"):
            from tasks.data import list_images
            list_images(src, "model.images.source")
        elif src not in schema.SYNTHETIC_IMAGES:
            raise ConfigError(f"model.images.source={src!r} is unknown",
                              fix=f"use {_in_words((*schema.SYNTHETIC_IMAGES, 'a folder of images'))}")
        check_recipe(m.images)


def check_recipe(images: DictConfig) -> None:
    """model.images: a known channel order and layout, and a mean and std per channel (GRAY: one value)."""
    for key, choices in (("channel_order", schema.CHANNEL_ORDERS), ("layout", schema.IMAGE_LAYOUTS)):
        if str(images[key]).upper() not in choices:
            raise ConfigError(f"model.images.{key}={images[key]!r} is unknown", fix=f"use {_in_words(choices)}")
    gray = str(images.channel_order).upper() == "GRAY"
    for key in ("mean", "std"):
        values = list(images[key])
        if gray and len(set(values)) > 1:
            raise ConfigError(f"model.images.{key}={values} has one value per colour channel, but "
                              "channel_order=GRAY gives one channel", fix=f"give one value, e.g. {key}: [{values[0]}]")
        if not gray and len(values) not in (1, 3):
            raise ConfigError(f"model.images.{key}={values} needs one value per channel ({images.channel_order}: 3)",
                              fix=f"give 3 values, e.g. {key}: [{', '.join([str(values[0])] * 3)}]")
        if key == "std" and any(v == 0 for v in values):
            raise ConfigError(f"model.images.std={values} has a 0 (the images are divided by it)",
                              fix="e.g. std: [1.0, 1.0, 1.0]")


def check_image_input(images: DictConfig, inputs: list) -> None:
    """The input model.images feeds has the recipe's channels where the model fixes them (3, or 1 for GRAY): a
    greyscale model fed colour images fails only deep inside a stage otherwise."""
    i = next(i for i in inputs if i.name == images.input)
    axis = 1 if str(images.layout).upper() == "NCHW" else 3
    want = 1 if str(images.channel_order).upper() == "GRAY" else 3
    have = i.shape[axis] if len(i.shape) == 4 else None
    if i.shape and len(i.shape) != 4:  # (a rank the graph does not state is left to the stages)
        raise ConfigError(f"model.images.input={images.input!r} has shape {list(i.shape)}: images feed a 4-D input "
                          f"({str(images.layout).upper()})", fix="give calibration.data instead, or name a 4-D input")
    if isinstance(have, int) and have > 0 and have != want:
        fix = "channel_order: GRAY" if have == 1 else "channel_order: RGB or BGR" if have == 3 else \
            "calibration.data instead of model.images"
        raise ConfigError(f"model.images: channel_order={images.channel_order} gives {want} channel(s), but input "
                          f"{images.input!r} has {have} (shape {list(i.shape)}, {str(images.layout).upper()})",
                          fix=f"use {fix}" + (", or the other model.images.layout" if have not in (1, 3) else ""))


def check_numbers(cfg: DictConfig, config_dir: str | None) -> None:
    """Numbers inside their ranges, and the accuracy metric loadable with its settings."""
    cal = cfg.calibration
    if cal.budget_margin is not None and not 0.0 <= cal.budget_margin < 1.0:
        raise ConfigError(f"calibration.budget_margin={cal.budget_margin} is outside [0, 1)",
                          fix="e.g. 0.5, or leave it unset (null) to derive it from the samples")
    if cal.samples < 1:
        raise ConfigError(f"calibration.samples={cal.samples} must be at least 1", fix="e.g. calibration.samples=32")
    if not -1.0 <= cfg.accuracy.min_cosine <= 1.0:
        raise ConfigError(f"accuracy.min_cosine={cfg.accuracy.min_cosine} is outside [-1, 1]", fix="e.g. accuracy.min_cosine=0.99")
    from tasks.accuracy import from_config as accuracy_metric
    accuracy_metric(cfg.accuracy, config_dir_search(config_dir))  # unknown name, unimportable function, bad tolerance
    if not cfg.build.fp16_data_max > 0:
        raise ConfigError(f"build.fp16_data_max={cfg.build.fp16_data_max} must be positive",
                          fix="e.g. build.fp16_data_max=32768 (ModelOpt AutoCast's choice is 512)")
    if cfg.partition.min_subgraph_size < 1:
        raise ConfigError(f"partition.min_subgraph_size={cfg.partition.min_subgraph_size} must be >= 1", fix="e.g. 3")
    check_memory_budget(cfg.memory_budget_mib)
    for key in ("validation.samples", "benchmark.iterations", "benchmark.repeats"):
        if OmegaConf.select(cfg, key) < (0 if key == "validation.samples" else 1):
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)} is too small", fix=f"give {key} a positive number")


def check_memory_budget(budget: int | None) -> None:
    """memory_budget_mib, when set: positive, and within the host's memory (a budget the host cannot give protects
    nothing)."""
    if budget is None:
        return
    from tasks.common import host_total_mib
    total = host_total_mib()
    if budget < 256:
        raise ConfigError(f"memory_budget_mib={budget} is too small: a build's processes alone take a few hundred MiB",
                          fix="e.g. memory_budget_mib=4096, or leave it unset (75% of the host's available memory)")
    if total is not None and budget > total:
        raise ConfigError(f"memory_budget_mib={budget} is more than this host's memory ({total} MiB)",
                          fix=f"give at most {total}, or leave it unset (75% of the host's available memory)")


def check_outputs(cfg: DictConfig, outputs: list) -> None:
    """The accuracy settings fit the model's outputs: top1 needs a class axis, per-output tolerances name outputs it
    has (torch: known after export)."""
    names = [o.name for o in outputs]
    if cfg.accuracy.metric == "top1" and outputs and all(isinstance(o.shape[-1] if o.shape else 1, int) and
                                                         (o.shape[-1] if o.shape else 1) < 2 for o in outputs):
        raise ConfigError(f"accuracy.metric=top1 judges the argmax of each output's last axis, and no output of the "
                          f"model has a class axis ({', '.join(f'{o.name} {o.shape}' for o in outputs)})",
                          fix="use accuracy.metric=allclose or cosine")
    for out in cfg.accuracy.outputs:
        if names and out not in names:
            near = difflib.get_close_matches(out, names, n=1)
            raise ConfigError(f"accuracy.outputs.{out}: the model has no output {out!r}"
                              + (f" (did you mean {near[0]!r}?)" if near else ""),
                              fix=f"name one of its outputs: {', '.join(names)}")


def shapes_of(cfg: DictConfig, model: Any, inputs: list, search: list[Path]) -> tuple[list, Any, Any]:
    """The checked profiles (given, or proposed from model.traffic, which checks given ones against it), the shape
    rules data is drawn by, and the traffic (None without model.traffic)."""
    from tasks.data import check_profiles, shape_rules

    m = cfg.model
    profiles, traffic = OmegaConf.to_container(m.profiles), None
    if m.traffic.source:  # the profiles from the traffic (given profiles win and are checked against it)
        from tasks.data import check_multiples, graph_ties, named_ties
        from tasks.data import from_config
        given = check_multiples(OmegaConf.to_container(m.shape_multiple), inputs)
        ties = named_ties(inputs) + (graph_ties(model, inputs) if model is not None else [])
        traffic = from_config(OmegaConf.to_container(m.traffic), inputs, model,
                              check_profiles(profiles, inputs) if profiles else [], given, ties, search)
        profiles = profiles or traffic[1].profiles
    profiles = check_profiles(profiles, inputs)
    rules = shape_rules(inputs, profiles, model, OmegaConf.to_container(m.shape_multiple))
    if traffic is not None:
        from tasks.data import TrafficDraws
        rules.traffic = TrafficDraws(traffic[0])
    return profiles, rules, traffic


def data_of(cfg: DictConfig, inputs: list, profiles: list, rules: Any, calibrates: bool) -> tuple[Any, dict]:
    """The user's data read and checked against the model, and the disjoint calibration / search / validation sets;
    (the split, the user's data by config key)."""
    from tasks.data import as_user_data, load_data, split_data

    m, p, cal = cfg.model, cfg.precision, cfg.calibration
    user = {}
    for key in ("calibration.data", "validation.data"):
        path = OmegaConf.select(cfg, key)
        if path:  # all of it: the held-out shares are of every sample (the split says what it leaves unused)
            user[key] = as_user_data(key, load_data(path, inputs, profiles, key, rules=rules))
    data = split_data(inputs=inputs, profiles=profiles, rules=rules, calibrate=calibrates,
                      search=(calibrates or p.name == "fp16") and bool(cal.search), validate=bool(cfg.stages.validate),
                      calibration_data=user.get("calibration.data"), validation_data=user.get("validation.data"),
                      recipe=OmegaConf.to_container(m.images) if m.images is not None else None,
                      calibration_samples=cal.samples, validation_samples=cfg.validation.samples, seed=cfg.seed,
                      validation_seed=cfg.validation.seed, labelled=bool(cfg.validation.labels))
    return data, user


def check_labels(cfg: DictConfig, user: dict) -> None:
    """validation.labels: one per sample of validation.data, for a user metric function."""
    if not cfg.validation.labels:
        return
    if "validation.data" not in user:
        raise ConfigError(f"validation.labels={cfg.validation.labels!r} labels the samples of validation.data, "
                          "which is not set", fix="set validation.data=PATH too (the samples the labels belong to)")
    if cfg.accuracy.metric in schema.ACCURACY_METRICS:
        raise ConfigError(f"validation.labels is read only by a module:function metric (accuracy.metric="
                          f"{cfg.accuracy.metric})", fix="set accuracy.metric=module:function, or drop validation.labels")
    from tasks.accuracy import load_labels
    from tasks.data import batch_size
    load_labels(cfg.validation.labels, sum(batch_size(f) for f in user["validation.data"].feeds))


def paddle_cache(cfg) -> Path:
    """Where Paddle conversions are kept (preflight reads the model's inputs from them; export reuses them)."""
    return Path(cfg.cache_dir) / "paddle"


def model_io(cfg: DictConfig, search: list[Path], budget: Any = None) -> tuple[Any, list, list, dict | None]:
    """The model as preflight sees it: its ONNX graph (onnx, paddle; None for torch, exported later), inputs, outputs,
    and the quantization it arrived with. Given a memory ``budget``, weights that cannot fit in it are refused before
    they are loaded."""
    from tasks.graph import load_onnx
    from tasks.graph import graph_io

    m = cfg.model
    if m.format in ("onnx", "paddle"):
        src = model_path(cfg, search)  # a Paddle model converted once here (content-addressed); export reuses it
        from tasks.common.memory import fit_check, resident_bytes
        from tasks.graph.footprint import estimate_of
        from tasks.graph.load import external_data_files
        if budget is not None:  # the file alone, before it is read
            fit_check(estimate_of(src, None, resident_bytes()), budget, file=str(src))
        model = load_onnx(src, load_external_data=False)
        if external_data_files(model, Path(src).parent):
            if budget is not None:  # with its external data, before that is read
                fit_check(estimate_of(src, model, resident_bytes()), budget, file=str(src))
            model = load_onnx(src)
        inputs, outputs = graph_io(model)
        from tasks.prequant import quantization_of
        from tasks.prequant import weight_only_model
        q = quantization_of(model)
        # not recalibrated: needs no calibration data (a weight-only quantized model calibrates its activations)
        return model, inputs, outputs, (q if any(q.values()) and not weight_only_model(model) else None)
    if not m.factory:
        raise ConfigError("model.factory is not set for format=torch", fix="set model.factory=module.path:callable")
    if not m.inputs:
        raise ConfigError("model.inputs is empty for format=torch", fix="map each forward() argument to {shape: [...], dtype: float32}")
    from tasks.graph import TensorInfo
    # the export makes dims that vary across a profile (or the traffic) dynamic: the profile check must see them so
    varying = {(n, i) for prof in m.profiles for n, r in prof.items()
               for i, (lo, hi) in enumerate(zip(r.min, r.max)) if lo != hi}
    inputs = [TensorInfo(n, s.dtype, [f"{n}_dim{i}" if (n, i) in varying else d for i, d in enumerate(s.shape)])
              for n, s in m.inputs.items()]
    return None, inputs, [], None


def bind_constants(cfg: DictConfig, inputs: list) -> list:
    """model.constants: each names an input and fits its dtype and shape; no profile covers a bound input. Returns
    the inputs that remain (what profiles, data, validation and benchmarks see)."""
    from tasks.graph import array_from_constant

    constants = OmegaConf.to_container(cfg.model.constants)
    by_name = {i.name: i for i in inputs}
    for name, value in constants.items():
        if name not in by_name:
            near = difflib.get_close_matches(name, list(by_name), n=1)
            raise ConfigError(f"model.constants.{name}={value!r}: the model has no input {name!r}"
                              + (f" (did you mean {near[0]!r}?)" if near else ""),
                              fix=f"bind one of its inputs: {', '.join(by_name)}")
        i = by_name[name]
        array_from_constant(name, value, i.dtype, i.shape)
    for k, prof in enumerate(cfg.model.profiles):
        for name in prof:
            if name in constants:
                raise ConfigError(f"model.profiles[{k}].{name}: input {name!r} is bound by model.constants.{name}, so it "
                                  "has no shape to profile", fix=f"remove {name!r} from model.profiles[{k}]")
    return [i for i in inputs if i.name not in constants]


def flat_params(cfg: DictConfig) -> dict[str, str]:
    out: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = str(node)[:6000]

    walk("", OmegaConf.to_container(cfg, resolve=True))
    return out
