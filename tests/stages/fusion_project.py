"""A pipeline directory on a tiny Opus model (factory ``fusion_kit:tiny_lm``) for the fuse/kv_config tests."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

KIT = Path(__file__).resolve().parents[1] / "fusion" / "fusion_kit.py"
sys.path.insert(0, str(KIT.parent))

from fusion_kit import prompts, tiny_lm  # noqa: E402  (re-exported: the model the project's factory makes)

from opus.pipeline.context import StageContext  # noqa: E402
from opus.pipeline.spec import load_pipeline  # noqa: E402

__all__ = ["context", "make_project", "prompts", "tiny_lm"]


def make_project(root: Path, stages: list[dict[str, Any]], family: str = "mixtral",
                 model: dict[str, Any] | None = None) -> Path:
    (root / "fusion_kit.py").write_text(KIT.read_text())
    model = model or {"factory": "fusion_kit:tiny_lm", "args": {"family": family}}
    spec = {"name": "fz", "model": model,
            "workload": {"batch_size": 2, "input_len": 8, "output_len": 4, "warmup": 0, "repeats": 1},
            "run": {"threads": 1, "stall_timeout_s": 120}, "stages": stages}
    path = root / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def context(pipeline: Path, out: Path, stage_id: str, incoming: Path | None = None) -> StageContext:
    loaded = load_pipeline(pipeline)
    return StageContext(run_dir=out.parent, stage_id=stage_id, uses=loaded.spec.stage(stage_id).uses,
                        spec=loaded.spec, base_dir=loaded.base_dir, upstream={}, incoming=incoming, out_dir=out)
