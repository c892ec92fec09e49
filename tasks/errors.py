"""One exception family. Every message says what is wrong, where, and how to fix it (Polygraphy's rule)."""
from __future__ import annotations


class TrtforgeError(Exception):
    """Base class of every error trtforge reports to a user."""

    exit_code = 1

    def __init__(self, message: str, *, stage: str | None = None, file: str | None = None, fix: str | None = None):
        self.message = message
        self.stage = stage
        self.file = file
        self.fix = fix
        super().__init__(self.render())

    def render(self) -> str:
        where = []
        if self.stage:
            where.append(f"[{self.stage}]")
        if self.file:
            where.append(f"{self.file}:")
        text = " ".join(where + [self.message])
        if self.fix:
            text += f"\n  fix: {self.fix}"
        return text


class ConfigError(TrtforgeError):
    """Bad input found before any heavy work: a config key, a file, a value."""

    exit_code = 2


class StageError(TrtforgeError):
    """A stage ran and failed (a library error wrapped with the stage and the file)."""

    exit_code = 1


class AccuracyError(StageError):
    """The result is outside the accuracy budget."""


class UnavailableError(TrtforgeError):
    """What the build needs does not exist on this host (a GPU of the target's architecture, a backend)."""

    exit_code = 3
