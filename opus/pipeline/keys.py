"""Stage keys: computed before a stage runs, from everything that can change its result."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from opus.pipeline import replay
from opus.pipeline.fingerprint import fingerprint_source, fingerprint_text_set
from opus.pipeline.registry import StageType
from opus.pipeline.spec import PipelineSpec, StageSpec


def run_context_fingerprint(spec: PipelineSpec, base_dir: Path) -> dict[str, Any]:
    """What every stage depends on: the model source, its dtype/device, the data, the workload and,
    when set, the decisions replayed from another run."""
    context = {
        "model": fingerprint_source(spec.model.source(), base_dir),
        "dtype": spec.model.dtype,
        "device": spec.model.device,
        "calibration": fingerprint_text_set(spec.data.calibration, base_dir),
        "evaluation": fingerprint_text_set(spec.data.evaluation, base_dir),
        "workload": spec.workload.model_dump(mode="json"),
    }
    replayed = replay.fingerprint(spec.run.decisions_from, base_dir)
    # Only when set: the keys of runs that replay nothing stay what they were.
    return {**context, "decisions_from": replayed} if replayed else context


def key_parts(stage: StageSpec, stage_type: StageType, cfg: BaseModel, input_digests: dict[str, str],
              context: dict[str, Any]) -> dict[str, str]:
    """What a stage key is made of, each part hashed on its own, so a changed key can say what changed.

    The definition minus cosmetic fields (id, description), the code, the content digests of the
    input checkpoints, and each item of the run's context (model, data, workload, ...).
    """
    definition = {
        "uses": stage.uses,
        "with": cfg.model_dump(mode="json"),
        "gate": {k: v.model_dump(exclude_none=True) for k, v in sorted(stage.gate.items())},
        "on_fail": stage.on_fail,
        "retries": stage.retries,
    }
    parts = {"definition": _digest(definition), "code": stage_type.code_version,
             "inputs": _digest([input_digests[k] for k in stage.needs])}
    parts.update({f"context.{name}": _digest(value) for name, value in sorted(context.items())})
    return parts


def stage_key(parts: dict[str, str]) -> str:
    """The key: one hash over its parts (see key_parts)."""
    return _digest(parts)


def changed_parts(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Names of the parts that differ between two keys' parts (a part only one side has counts)."""
    return sorted(name for name in old.keys() | new.keys() if old.get(name) != new.get(name))


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
