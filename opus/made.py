"""What a run made, as a model: the one loader behind ``opus.load``, ``opus serve`` and ``opus lm-eval``.

Above both the run engine (a run directory, a stage's checkpoint) and the exports (an export directory):
an export takes a model and its recipe and never reads a run directory itself.
"""

from __future__ import annotations

from pathlib import Path

from opus.errors import InputError
from opus.export.native import EXPORT_FILE, load_exported
from opus.models.saved_state import Materialized
from opus.pipeline.checkpoint import MANIFEST, intact
from opus.pipeline.run_files import RUN_FILE, export_dirs, final_checkpoint, load_run
from opus.pipeline.state import materialize
from opus.trust import loading


def load_made(path: Path, device: str | None = None, trust_code: bool = False) -> tuple[Materialized, Path]:
    """The model of an export directory, of a run directory (its last export stage's export, else its
    final checkpoint) or of one stage's checkpoint in a run (``RUN/stages/NN-id``), and the directory it
    came from. None of these, or a run with nothing kept yet: ``InputError``.

    What it holds may come from a stranger: code named in its files (a factory, a module path) runs only
    with ``trust_code`` (opus.trust)."""
    with loading(path, trust_code):
        return _load_made(path, device, trust_code)


def _load_made(path: Path, device: str | None, trust_code: bool) -> tuple[Materialized, Path]:
    run_dir = path.parent.parent
    if path.parent.name == "stages" and (path / MANIFEST).is_file() and (run_dir / RUN_FILE).is_file():
        run_pipeline = load_run(run_dir)
        return materialize(intact(path), run_pipeline.spec, run_pipeline.base_dir, device), path
    if not (path / RUN_FILE).is_file():
        if not (path / EXPORT_FILE).is_file():
            raise InputError(f"not an export directory ({EXPORT_FILE}), a run directory ({RUN_FILE}) or a "
                             f"stage's checkpoint in one", file=str(path))
        return load_exported(path, device, trust_code=trust_code), path
    exports = export_dirs(path)
    if exports:
        return load_exported(exports[-1], device, trust_code=trust_code), exports[-1]
    checkpoint, _ = final_checkpoint(path)
    if checkpoint is None:
        raise InputError("the run has no kept stage yet: nothing to load", file=str(path))
    run_pipeline = load_run(path)
    return materialize(intact(checkpoint), run_pipeline.spec, run_pipeline.base_dir, device), checkpoint
