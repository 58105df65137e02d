"""Runs one stage attempt in its own process: ``python -m opus.pipeline.worker JOB.json PROGRESS_FD``.

The runner supervises this process (heartbeats, time limits) and never holds a model itself, so a
stage that crashes, is killed for memory or hangs cannot take the run down with it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from opus import compile_watch
from opus.errors import OpusError
from opus.models.saved_state import changed_tensors
from opus.pipeline.checkpoint import is_disk_full, write_checkpoint
from opus.pipeline.context import StageContext, StageResult
from opus.pipeline.contracts import Job, ResultRecord, WorkerError
from opus.pipeline.registry import load_stage_type
from opus.pipeline.spec import load_pipeline
from opus.pipeline.state import read_state
from opus.recipe import stored_recipe

EXIT_CRASH = 1
EXIT_DISK = 4


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the runner dies, so no orphan keeps writing into the run directory."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _channel(fd: int):  # noqa: ANN202
    stream = os.fdopen(fd, "w", buffering=1)

    def report(message: dict[str, Any]) -> None:
        try:
            stream.write(json.dumps(message, default=str) + "\n")
        except (BrokenPipeError, ValueError):
            pass

    return report


def _jsonable_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in metrics.items():
        if hasattr(value, "item"):
            value = value.item()
        out[key] = value
    return out


def _finish(ctx: StageContext, job: Job, result: StageResult, started: float) -> None:
    incoming = job.incoming
    record = ResultRecord(
        status="done", metrics=_jsonable_metrics(result.metrics), baseline=result.baseline,
        info=json.loads(json.dumps(result.info, default=str)), attempt=job.attempt, config=job.config,
        remedy=job.remedy, duration_s=round(time.monotonic() - started, 3), warnings=list(result.warnings))
    common = dict(key=job.key, key_parts=job.key_parts, stage_id=job.stage_id, uses=job.uses, result=record,
                  reserve_mb=ctx.spec.run.min_free_disk_mb)
    if result.model is None:
        state = read_state(incoming, ctx.spec)
        # A recipe-only step (e.g. a KV cache choice) changes no tensor: keep the incoming ones.
        state = {**state, "recipe": list(state["recipe"]) + stored_recipe(result.recipe)}
        write_checkpoint(ctx.out_dir, state=state, inherit_tensors_from=incoming, **common)
        return
    loaded = ctx._loaded
    marks = loaded.base_marks if loaded is not None else {}
    prior = loaded.state if loaded is not None else read_state(incoming, ctx.spec)
    tensors, aliases = changed_tensors(result.model, marks)
    state = {"source": prior["source"], "recipe": list(prior["recipe"]) + stored_recipe(result.recipe),
             "aliases": aliases}
    write_checkpoint(ctx.out_dir, state=state, tensors=tensors, **common)


def main(argv: list[str]) -> int:
    _die_with_parent()
    job = Job.read(Path(argv[0]))
    report = _channel(int(argv[1]))
    out_dir = job.out_dir
    started = time.monotonic()
    try:
        loaded = load_pipeline(job.pipeline, base_dir=job.base_dir, check_paths=False)
        stage_type = load_stage_type(job.uses)
        cfg = stage_type.config_class.model_validate(job.config)
        ctx = StageContext(
            run_dir=job.run_dir, stage_id=job.stage_id, uses=job.uses, spec=loaded.spec, base_dir=job.base_dir,
            upstream={u.id: u for u in job.upstream}, incoming=job.incoming, out_dir=out_dir,
            attempt=job.attempt, remedy=job.remedy, report=report, key=job.key, config=job.config)
        compile_watch.report_to(ctx.compiling)
        result = stage_type.module.run(ctx, cfg)
        if not isinstance(result, StageResult):
            raise TypeError(f"stage type '{job.uses}' returned {type(result).__name__}, not StageResult")
        report({"t": "progress", "done": 1, "total": 1, "what": "writing checkpoint"})
        _finish(ctx, job, result, started)
        return 0
    except Exception as exc:  # noqa: BLE001 - any stage failure is recorded, the run decides
        kind = failure_kind(exc)
        if kind != "disk":
            traceback.print_exc()
        message = str(exc) if isinstance(exc, OpusError) else f"{type(exc).__name__}: {exc}"
        try:
            WorkerError(kind=kind, message=message.splitlines()[0][:500]).write(out_dir)
        except OSError as error:  # a disk too full for even the error report: that is the failure now
            if not is_disk_full(error):
                raise
            kind = "disk"
        return EXIT_DISK if kind == "disk" else EXIT_CRASH


# Failures that repeat on every attempt: bad input, a missing or unreadable file, an operation
# this build cannot do. Retrying them only delays the verdict.
PERMANENT = (OpusError, FileNotFoundError, IsADirectoryError, NotADirectoryError, UnicodeDecodeError,
             NotImplementedError, ImportError)


def failure_kind(exc: BaseException) -> str:
    """``disk`` (can pass once space is freed), ``input`` (repeats on retry) or ``crash``."""
    if is_disk_full(exc):
        return "disk"
    if isinstance(exc, PERMANENT) or type(exc).__name__ == "SafetensorError":  # a damaged tensor file
        return "input"
    return "crash"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
