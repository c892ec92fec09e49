"""Prefect's `flow`/`task` decorators, applied on first use: a build that turns out to be up to date never imports
Prefect (about a second of imports, plus a temporary server on the first flow run)."""
from __future__ import annotations

from typing import Any, Callable

NONE = "NONE"  # stands for prefect.cache_policies.NONE until Prefect is imported


class Deferred:
    def __init__(self, kind: str, fn: Callable, opts: dict[str, Any]):
        self.kind, self.fn, self.opts, self._obj = kind, fn, opts, None
        self.__name__, self.__doc__, self.__wrapped__ = fn.__name__, fn.__doc__, fn

    def prefect(self):
        if self._obj is None:
            import prefect
            from prefect.cache_policies import NONE as none

            opts = {k: (none if v is NONE else v) for k, v in self.opts.items()}
            self._obj = getattr(prefect, self.kind)(**opts)(self.fn)
        return self._obj

    def __call__(self, *args, **kwargs):
        return self.prefect()(*args, **kwargs)

    def __getattr__(self, name: str):  # .serve, .submit, .with_options, ...
        return getattr(self.prefect(), name)


def task(**opts: Any) -> Callable[[Callable], Deferred]:
    return lambda fn: Deferred("task", fn, opts)


def flow(**opts: Any) -> Callable[[Callable], Deferred]:
    return lambda fn: Deferred("flow", fn, opts)
