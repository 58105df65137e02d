"""Errors that the CLI turns into one-line messages and exit codes, never tracebacks."""

from __future__ import annotations

from typing import Any

EXIT_OK = 0
EXIT_INVALID = 2
EXIT_RUN_FAILED = 3
EXIT_DEGRADED = 4  # finished with stages rolled back or skipped: a model, but not all that was asked
EXIT_INTERRUPTED = 130


class OpusError(Exception):
    """Base class; ``exit_code`` is what the CLI returns."""

    exit_code = EXIT_RUN_FAILED


class InputError(OpusError):
    """Bad user input: the message names the file, line and key."""

    exit_code = EXIT_INVALID

    def __init__(self, message: str, file: str | None = None, line: int | None = None,
                 key: str | None = None) -> None:
        self.message, self.file, self.line, self.key = message, file, line, key
        where = file or ""
        if file and line:
            where = f"{file}:{line}"
        prefix = ": ".join(p for p in (where, key) if p)
        super().__init__(f"{prefix}: {message}" if prefix else message)


class RunLockedError(OpusError):
    """Another process holds the run directory."""

    exit_code = EXIT_INVALID


class RunFailed(OpusError):
    """The run stopped: a stage failed and its policy said abort, or it could not continue."""

    exit_code = EXIT_RUN_FAILED


def first_complaint(exc: Any) -> tuple[str | None, str, bool]:
    """The complaint of a pydantic ``ValidationError`` a person should read first, as (dotted key or None,
    pydantic's message, whether the key is one the model does not have): a misspelt key comes before the
    missing one it implies, since the misspelling is what the person typed."""
    errors = exc.errors()
    error = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    key = ".".join(str(part) for part in error["loc"]) or None
    return key, str(error["msg"]), error["type"] == "extra_forbidden"
