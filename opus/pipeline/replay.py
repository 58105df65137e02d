"""Replaying another run's decisions: ``run.decisions_from`` (``opus run P --decisions-from RUN_DIR``).

For exact reproduction on another machine, the stages that decide from timings take what the earlier
run chose instead of timing: plan takes its plan.yaml (as ``plan_file`` would), kv_config its chosen
cache, fuse its compile choice. Each file is looked up under the same stage id in the earlier run
(published ``artifacts/<id>/``, else the checkpoint's ``stages/NN-<id>/artifacts/`` of a run that did
not finish), else as the latest kept stage's file of that name.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from opus.errors import InputError
from opus.fusion.rewrite import FUSION_FILE
from opus.kv.choice import KV_CONFIG_FILE
from opus.pipeline.run_files import ARTIFACTS_DIR, find_artifact
from opus.quant.plan_file import PLAN_FILE

REPLAYED = (PLAN_FILE, KV_CONFIG_FILE, FUSION_FILE)  # the files the deciding stages replay


def source_run(decisions_from: str | None, base_dir: Path) -> Path | None:
    """The run directory to replay (relative paths are the pipeline file's, as every path), or None."""
    if not decisions_from:
        return None
    path = Path(decisions_from).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if not path.is_dir():
        raise InputError("run.decisions_from: no such run directory", file=str(path))
    return path


def source_artifact(ctx: Any, name: str) -> Path | None:
    """The earlier run's ``name`` for this stage (``ctx`` is the StageContext), or None when this run
    replays nothing. A run to replay that lacks the file is an input error: nothing to reproduce."""
    run_dir = source_run(ctx.spec.run.decisions_from, ctx.base_dir)
    if run_dir is None:
        return None
    unpublished = sorted((run_dir / "stages").glob(f"[0-9][0-9]-{ctx.stage_id}/{ARTIFACTS_DIR}/{name}"))
    for path in [run_dir / ARTIFACTS_DIR / ctx.stage_id / name, *unpublished[-1:]]:
        if path.is_file():
            return path
    found = find_artifact(run_dir, name)
    if found is None:
        raise InputError(f"run.decisions_from: the run has no {name} to replay for stage '{ctx.stage_id}'",
                         file=str(run_dir))
    return found[1]


def fingerprint(decisions_from: str | None, base_dir: Path) -> dict[str, Any] | None:
    """For stage keys: a hash of the replayed run's decision files (not of its path: the same decisions
    copied elsewhere replay alike), so that a stage re-runs when they change. None: nothing replayed."""
    run_dir = source_run(decisions_from, base_dir)
    if run_dir is None:
        return None
    digest = hashlib.sha256()
    for pattern in (f"{ARTIFACTS_DIR}/*/", f"stages/*/{ARTIFACTS_DIR}/"):
        for path in sorted(p for name in REPLAYED for p in run_dir.glob(pattern + name)):
            digest.update(str(path.relative_to(run_dir)).encode() + b"\0" + path.read_bytes())
    return {"sha256": digest.hexdigest()}
