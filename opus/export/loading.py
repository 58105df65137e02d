"""What a run or an export directory holds, as a model: the one loader behind ``opus.load`` and ``opus serve``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opus.errors import InputError
from opus.export.native import EXPORT_FILE, load_exported
from opus.pipeline.run_files import RUN_FILE, export_dirs, final_checkpoint, load_run
from opus.pipeline.state import Materialized, materialize


def load_made(path: Path, device: str | None = None) -> tuple[Materialized, Path]:
    """The model of an export directory, or of a run directory (its last export stage's export, else its
    final checkpoint), and the directory it came from. Neither kind, or a run with nothing kept yet:
    ``InputError``."""
    if not (path / RUN_FILE).is_file():
        if not (path / EXPORT_FILE).is_file():
            raise InputError(f"neither an export directory ({EXPORT_FILE}) nor a run directory ({RUN_FILE})",
                             file=str(path))
        return load_exported(path, device), path
    exports = export_dirs(path)
    if exports:
        return load_exported(exports[-1], device), exports[-1]
    checkpoint, _ = final_checkpoint(path)
    if checkpoint is None:
        raise InputError("the run has no kept stage yet: nothing to load", file=str(path))
    run_pipeline = load_run(path)
    return materialize(checkpoint, run_pipeline.spec, run_pipeline.base_dir, device), checkpoint


def eos_ids(tokenizer: Any, model: Any) -> frozenset[int]:
    """The end-of-sequence ids the tokenizer and the model's config name (either may be a list)."""
    found: set[int] = set()
    config = getattr(model, "config", None)
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        found.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    return frozenset(found)
