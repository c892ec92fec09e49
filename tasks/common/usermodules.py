"""The user's own Python modules (a torch factory, an accuracy metric): where they are imported from, and imported
afresh each time so that an edited module is seen by a long-lived process and by the stage's file recording."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def add_import_paths(search: list[Path] | None) -> None:
    """A factory module may sit in the working directory or in the user's config directory."""
    for d in [Path.cwd(), *(search or [])]:
        if str(d) not in sys.path:
            sys.path.insert(0, str(d))


def fresh_user_modules(module_name: str, search: list[Path] | None) -> None:
    """Forget the factory's module and every module loaded from the user's config dir, so that this export imports
    them as they are now (a long-lived process, e.g. the scheduled rebuild, sees an edited module) and the stage's
    recording sees the files it reads; the factory module's folder is recorded as read too."""
    from tasks.common.deps import note

    roots = [str(Path(d).resolve()) + "/" for d in (search or [])]
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None) or ""
        if name == module_name or name.startswith(module_name + ".") or (roots and f.startswith(tuple(roots))):
            del sys.modules[name]
    try:
        spec = importlib.util.find_spec(module_name) if module_name else None
    except (ImportError, ValueError):  # the import itself reports it, as a ConfigError
        spec = None
    if spec and spec.origin and Path(spec.origin).is_file():
        note(spec.origin)
