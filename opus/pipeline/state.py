"""A checkpoint's model state (opus.models.saved_state) read against the pipeline's model source."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opus.atomic import read_json
from opus.models.saved_state import Materialized, apply_state
from opus.pipeline.spec import PipelineSpec

STATE_FILE = "state.json"
TENSORS_FILE = "tensors.safetensors"


def base_state(spec: PipelineSpec) -> dict[str, Any]:
    return {"source": spec.model.source(), "recipe": [], "tensors": None, "aliases": {}}


def read_state(checkpoint: Path | None, spec: PipelineSpec) -> dict[str, Any]:
    return read_json(checkpoint / STATE_FILE) if checkpoint else base_state(spec)


def load_base(spec: PipelineSpec, base_dir: Path, device: str | None = None) -> tuple[Any, Any]:
    from opus.models import load_model

    loaded = load_model(spec.model.source(), base_dir, dtype=spec.model.dtype, device=device or spec.model.device)
    return loaded if isinstance(loaded, tuple) else (loaded, None)


def materialize(checkpoint: Path | None, spec: PipelineSpec, base_dir: Path,
                device: str | None = None) -> Materialized:
    """A checkpoint's model (None: the base model), on ``device`` (default: the pipeline's)."""
    state = read_state(checkpoint, spec)
    model, tokenizer = load_base(spec, base_dir, device)
    return apply_state(model, tokenizer, state, checkpoint, device or spec.model.device)
