"""The metric from the ``accuracy`` config section, checked before any heavy work: built-in settings, the user's
``module:function`` imported (fresh, so an edited file is what runs), and the fingerprint of that function's module."""
from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any, Callable

from tasks.common.errors import ConfigError
from tasks.accuracy.metric import BUILTIN, Metric


def from_config(acc: Any, search: list[Path] | None = None) -> Metric:
    """The metric of ``accuracy`` (the typed config section, a DictConfig or a dict), checked: an unknown name, a
    ``module:function`` that cannot be imported, a negative tolerance or a threshold outside [0, 1] is a ConfigError
    naming the key, the value and the fix (before any heavy work)."""
    get = (lambda k, d=None: acc.get(k, d)) if isinstance(acc, dict) else (lambda k, d=None: getattr(acc, k, d))
    name = str(get("metric", "cosine") or "cosine")
    outputs = get("outputs") or {}
    outputs = {str(k): {kk: float(vv) for kk, vv in dict(v).items() if vv is not None} for k, v in dict(outputs).items()}
    m = Metric(name=name, min_cosine=float(get("min_cosine", 0.99)), atol=float(get("atol", 1e-5)),
               rtol=float(get("rtol", 1e-5)), outputs=outputs, min_within=float(get("min_within", 1.0)),
               min_agreement=float(get("min_agreement", 0.99)), greater_is_better=bool(get("greater_is_better", True)),
               gate_logits=bool(get("gate_logits", False)))
    for key in ("atol", "rtol"):
        v = getattr(m, key)
        if not (v >= 0 and math.isfinite(v)):
            raise ConfigError(f"accuracy.{key}={v} must be a finite number >= 0", fix=f"e.g. accuracy.{key}=1e-5")
        for out, t in outputs.items():
            if key in t and not (t[key] >= 0 and math.isfinite(t[key])):
                raise ConfigError(f"accuracy.outputs.{out}.{key}={t[key]} must be a finite number >= 0",
                                  fix=f"e.g. accuracy.outputs.{out}.{key}=1e-5")
    for out, t in outputs.items():
        if set(t) - {"atol", "rtol"}:
            raise ConfigError(f"accuracy.outputs.{out} has {sorted(set(t) - {'atol', 'rtol'})[0]!r}",
                              fix="per output, give atol and/or rtol")
    for key in ("min_within", "min_agreement"):
        v = getattr(m, key)
        if not 0.0 <= v <= 1.0:
            raise ConfigError(f"accuracy.{key}={v} is outside [0, 1]", fix=f"e.g. accuracy.{key}=0.99 (a share)")
    if outputs and name != "allclose":
        raise ConfigError(f"accuracy.outputs sets per-output tolerances, which only accuracy.metric=allclose uses "
                          f"(accuracy.metric={name})", fix="set accuracy.metric=allclose, or remove accuracy.outputs")
    if name in BUILTIN:
        return m
    mod_name, sep, fn_name = name.partition(":")
    if not sep or not mod_name or not fn_name:
        import difflib
        near = difflib.get_close_matches(name, BUILTIN, n=1)
        raise ConfigError(f"accuracy.metric={name!r} is unknown" + (f" (did you mean {near[0]!r}?)" if near else ""),
                          fix="use cosine, allclose, top1, or module:function (your own, in the working directory or "
                              "the config dir)")
    m.fn, m.origin = load_function(name, search)
    return m


def load_function(name: str, search: list[Path] | None = None) -> tuple[Callable, str | None]:
    """``module:function`` imported as a torch factory is (the working directory, then the config dir, on sys.path;
    the module imported fresh so that an edited file is what runs)."""
    from tasks.common.usermodules import add_import_paths, fresh_user_modules

    mod_name, _, fn_name = name.partition(":")
    add_import_paths(search)
    fresh_user_modules(mod_name, search)
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - ImportError, or the module's own error at import
        raise ConfigError(f"accuracy.metric={name!r} cannot be imported: {type(e).__name__}: {e}",
                          fix="put the module in the working directory or the config dir (--config-dir), or fix it"
                          ) from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"accuracy.metric={name!r}: module {mod_name!r} has no function {fn_name!r}",
                          file=getattr(mod, "__file__", None),
                          fix=f"define def {fn_name}(outputs, references, feeds): ... returning (score, passed)")
    return fn, getattr(mod, "__file__", None)


def fingerprint(acc: Any, search: list[Path] | None = None) -> dict | None:
    """What a user function's result depends on beyond the config: its module file's sha256 (None for built-ins)."""
    name = str((acc.get("metric") if isinstance(acc, dict) else getattr(acc, "metric", None)) or "cosine")
    if name in BUILTIN or ":" not in name:
        return None
    import importlib.util

    from tasks.common.usermodules import add_import_paths
    from tasks.common.util import sha256_file

    add_import_paths(search)
    try:
        spec = importlib.util.find_spec(name.partition(":")[0])
    except (ImportError, ValueError):
        spec = None
    origin = spec.origin if spec else None
    return {"metric": name, "module_sha256": sha256_file(origin) if origin and Path(origin).is_file() else None}
