"""Where a build's time goes around its stages: with TRTFORGE_TIMELINE=FILE, each build run by the CLI appends one JSON
line to FILE: its marks (phase name, epoch seconds) from the command's start to the run's end. benchmarks/bench_build.py
reads them to split the overhead of a real run (instead of timing the pieces again in another process). Off by default;
standard library only."""
from __future__ import annotations

import json
import os
import time

_marks: list[tuple[str, float]] = []


def mark(name: str, at: float | None = None) -> None:
    if os.environ.get("TRTFORGE_TIMELINE"):
        _marks.append((name, time.time() if at is None else at))


def flush() -> None:
    """Append the marks so far as one line to $TRTFORGE_TIMELINE, and start over."""
    path = os.environ.get("TRTFORGE_TIMELINE")
    if path and _marks:
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "marks": _marks}) + "\n")
    _marks.clear()
