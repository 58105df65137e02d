"""Stage keys: computed before a stage runs, from everything that can change its result."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from opus import replay
from opus.fingerprint import fingerprint_source, fingerprint_text_set
from opus.registry import StageType
from opus.spec import PipelineSpec, StageSpec


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


def stage_key(stage: StageSpec, stage_type: StageType, cfg: BaseModel,
              input_keys: dict[str, str], context: dict[str, Any]) -> str:
    """Hash of the stage definition minus cosmetic fields (id, description) and all its inputs."""
    payload = {
        "uses": stage.uses,
        "with": cfg.model_dump(mode="json"),
        "gate": {k: v.model_dump(exclude_none=True) for k, v in sorted(stage.gate.items())},
        "on_fail": stage.on_fail,
        "retries": stage.retries,
        "code": stage_type.code_version,
        "inputs": [input_keys[k] for k in stage.needs],
        "context": context,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
