"""A package's entry points, imported on first use (PEP 562): a package names each name it exports and the module
that defines it, so ``from tasks.fp16 import fp16_from_onnx`` works while importing one module of a package never pays
for the others (the CLI decides whether a build is up to date before any ONNX or numpy import)."""
from __future__ import annotations

from importlib import import_module
from typing import Callable


def lazy(package: str, table: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """``__getattr__``, ``__dir__`` and ``__all__`` for `package`, whose `table` maps each exported name to the
    module (relative to the package) that defines it."""

    def __getattr__(name: str) -> object:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(f"{package}.{module}"), name)

    def __dir__() -> list[str]:
        return sorted(table)

    return __getattr__, __dir__, sorted(table)
