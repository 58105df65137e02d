"""The runner: validated DAG -> one supervised worker per stage -> checkpoint -> gate -> next.

A stage is finished when its checkpoint is committed; resume re-runs nothing finished whose key
still matches. Keys chain the content digests of the input checkpoints, so a rebuilt input with
other content re-runs exactly its descendants. A failed gate, crash or hang rolls back and follows
the stage's ``on_fail``: retry with the stage's remedy (out of retries: abort), skip (pass on the
last verified checkpoint), or abort. Bad input is never retried; a failed baseline ends the run. A
rollback for a cause that can pass (crash, stall, timeout, full disk) is run again on resume. The
run's status comes from opus.pipeline.verdict.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opus.atomic import new_temp_dir, relative_path, write_json, write_yaml
from opus.atomic import replace_dir as commit
from opus.errors import RunFailed
from opus.pipeline.checkpoint import (
    DiskSpaceError,
    check_free_disk,
    clean_temporaries,
    content_digest,
    drop_tensors,
    estimate_checkpoint_bytes,
    find_checkpoint,
    is_disk_full,
    move_aside,
    read_manifest,
    read_manifest_key,
    write_checkpoint,
)
from opus.pipeline.contracts import JOB_FILE, Failure, GateVerdict, Job, ResultRecord, UpstreamView, read_result
from opus.pipeline.events import EventLog, Observers, RunObserver
from opus.pipeline.gates import check_gate, verified
from opus.pipeline.graph import ancestors, execution_order, validate
from opus.pipeline.keys import changed_parts, key_parts, run_context_fingerprint, stage_key
from opus.pipeline.lock import RunLock
from opus.pipeline.progress import ProgressFile
from opus.pipeline.run_files import (
    PIPELINE_FILE,
    RUN_FILE,
    SUMMARY_FILE,
    read_run_info,
    source_bytes,
)
from opus.pipeline.spec import LoadedPipeline
from opus.pipeline.state import read_state
from opus.pipeline.summary import build_summary
from opus.pipeline.supervise import WorkerOutcome, run_worker
from opus.pipeline.units import clear_units
from opus.pipeline.verdict import KEPT, TRANSIENT_FAILURES, run_status
from opus.runtime.machine import STAGE_THREADS, auto_threads

DISK_FULL = "the disk is full; committed checkpoints are intact: free disk space, then `opus resume`"


@dataclass
class StageRecord:
    id: str
    uses: str
    key: str
    status: str  # done | cached | rolled_back | failed | skipped
    role: str = "transform"  # opus.pipeline.registry.ROLES
    dir: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    baseline: bool = False
    gate: GateVerdict | None = None
    attempts: int = 0
    duration_s: float | None = None
    note: str = ""
    warnings: list[str] = field(default_factory=list)  # the stage's own (StageResult.warnings)

    def as_json(self, run_dir: Path | None = None) -> dict[str, Any]:
        """The summary's row for this stage (``dir`` relative to ``run_dir`` when given)."""
        row = {**asdict(self), "gate": self.gate.as_json() if self.gate else None}
        if run_dir is not None and self.dir:
            row["dir"] = relative_path(self.dir, run_dir)
        return row

    def upstream_view(self) -> UpstreamView:
        assert self.dir is not None  # only stages with a checkpoint are upstream of anything
        return UpstreamView(id=self.id, uses=self.uses, key=self.key, status=self.status, metrics=self.metrics,
                            dir=Path(self.dir), baseline=self.baseline)


class Runner:
    def __init__(self, loaded: LoadedPipeline, run_dir: Path, observer: RunObserver) -> None:
        """``observer`` shows the run (opus.cli.run_display); progress.json is kept whatever it is."""
        self.loaded, self.spec = loaded, loaded.spec
        self.graph, self.types = validate(loaded)
        # Once, before anything runs: a stage type declaring an unknown ROLE fails here, not mid-run.
        self.roles = {stage_id: stage_type.role(cfg) for stage_id, (stage_type, cfg) in self.types.items()}
        self.run_dir = run_dir.resolve()
        self.stages_dir = self.run_dir / "stages"
        self.events = EventLog(self.run_dir)
        self.observer = observer
        self.observers: RunObserver = observer  # during run(): progress.json's writer too
        self.records: dict[str, StageRecord] = {}
        self.rollbacks: list[dict[str, Any]] = []
        self.key_parts: dict[str, dict[str, str]] = {}

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        with RunLock(self.run_dir):
            resumed = self._prepare()
            self.events.emit("run_resumed" if resumed else "run_started", pid=os.getpid())
            stopped, error = None, None
            order = execution_order(self.graph)
            try:
                with ProgressFile(self.run_dir) as progress_file:
                    self.observers = Observers(progress_file, self.observer)
                    self.observers.begin(order)
                    for stage_id in order:
                        self._run_stage(stage_id)
            except KeyboardInterrupt:
                stopped, error = "interrupted", "stopped by the user; `opus resume` continues"
            except RunFailed as exc:
                stopped, error = "failed", str(exc)
            except OSError as exc:  # the runner's own writes (a pass-through checkpoint, events) on a full disk
                if not is_disk_full(exc):
                    raise
                stopped, error = "failed", f"{DISK_FULL} ({exc})"
            for stage_id in order:
                if stage_id not in self.records:
                    stage = self.spec.stage(stage_id)
                    self.records[stage_id] = StageRecord(stage_id, stage.uses, "", "skipped", self._role(stage_id),
                                                         note="not run: the run ended before it")
            records = [self.records[s].as_json(self.run_dir) for s in order]
            status, reasons = run_status(records, stopped)
            summary = build_summary(self.run_dir.name, status, records, self.rollbacks, error, reasons)
            try:
                write_json(self.run_dir / SUMMARY_FILE, summary)
                self.events.emit("run_" + status, error=error, reasons=reasons, warnings=summary["warnings"])
            except OSError as exc:
                if not is_disk_full(exc):
                    raise
                raise RunFailed(f"cannot write {SUMMARY_FILE}: {DISK_FULL}") from None
            return summary

    def _prepare(self) -> bool:
        self.stages_dir.mkdir(parents=True, exist_ok=True)
        for path in clean_temporaries(self.stages_dir):
            self.events.emit("temporary_removed", path=path.name)
        # Rollbacks of earlier starts stay on record: a resume may redo the stage, not the history.
        self.rollbacks = [{k: v for k, v in e.items() if k != "event"}
                          for e in self.events.read() if e.get("event") == "rollback"]
        write_yaml(self.run_dir / PIPELINE_FILE, self.loaded.raw)
        run_file = self.run_dir / RUN_FILE
        info = read_run_info(run_file) if run_file.is_file() else {
            "run_id": self.run_dir.name, "created": time.time(), "host": socket.gethostname(),
            "starts": []}
        # Relative to the run directory: a run moved, copied or committed to git reads the same.
        info.update(pipeline=relative_path(self.loaded.path, self.run_dir),
                    base_dir=relative_path(self.loaded.base_dir, self.run_dir), name=self.spec.name)
        info["starts"].append(time.time())
        write_json(run_file, info)
        self.context = run_context_fingerprint(self.spec, self.loaded.base_dir)
        self.base_model_bytes = source_bytes(self.spec.model.source(), self.loaded.base_dir)
        return len(info["starts"]) > 1

    def resume_plan(self) -> list[dict[str, Any]]:
        """What a resume would do with each stage, touching nothing: reuse, retry or recompute, and why."""
        self.context = run_context_fingerprint(self.spec, self.loaded.base_dir)
        digests: dict[str, str] = {}
        plan = []
        for stage_id in execution_order(self.graph):
            stage = self.spec.stage(stage_id)
            stage_type, cfg = self.types[stage_id]
            rebuilt = [n for n in stage.needs if n not in digests]
            if rebuilt:
                plan.append({"stage": stage_id, "action": "recompute", "why": f"its input '{rebuilt[0]}' is rebuilt"})
                continue
            parts = key_parts(stage, stage_type, cfg, {n: digests[n] for n in stage.needs}, self.context)
            key = stage_key(parts)
            path, problem = find_checkpoint(self.stages_dir, stage_id, key)
            entry = {"stage": stage_id, "action": "recompute", "checkpoint": path.name if path else None}
            if problem:
                entry["why"] = f"damaged: {problem}"
            elif path is None:
                entry["why"] = self._why_no_checkpoint(stage_id, parts)
            else:
                failure = read_result(path).failure
                if failure and failure.kind in TRANSIENT_FAILURES:
                    entry.update(action="retry", why=f"rolled back for a cause that can pass ({failure.kind})")
                else:
                    entry.update(action="reuse", why="hashes and lineage verify", key=key)
                    digests[stage_id] = content_digest(path)
            plan.append(entry)
        return plan

    def _why_no_checkpoint(self, stage_id: str, parts: dict[str, str]) -> str:
        for path in sorted(self.stages_dir.glob(f"[0-9][0-9]-{stage_id}")):
            old = (read_manifest(path).get("key_parts") if read_manifest_key(path) else None) or {}
            if old:
                return f"its checkpoint {path.name} was made with another {', '.join(changed_parts(old, parts))}"
        return "no checkpoint yet"

    def _role(self, stage_id: str) -> str:
        return self.roles[stage_id]

    # -- one stage -------------------------------------------------------------------------
    def _run_stage(self, stage_id: str) -> None:
        stage = self.spec.stage(stage_id)
        stage_type, cfg = self.types[stage_id]
        # Content-addressed lineage: a rebuilt input with other content gives this stage a new key.
        input_digests = {n: content_digest(Path(self.records[n].dir)) for n in stage.needs}
        self.key_parts[stage_id] = key_parts(stage, stage_type, cfg, input_digests, self.context)
        key = stage_key(self.key_parts[stage_id])
        index = self.graph.nodes[stage_id]["index"]
        final = self.stages_dir / f"{index:02d}-{stage_id}"
        if self._reuse(stage_id, key):
            return
        incoming = Path(self.records[stage.needs[-1]].dir) if stage.needs else None
        self._execute(stage_id, key, final, incoming)

    def _reuse(self, stage_id: str, key: str) -> bool:
        path, problem = find_checkpoint(self.stages_dir, stage_id, key)
        if problem:
            moved = move_aside(path, self.run_dir / "discarded")
            self.observers.warn(f"checkpoint {path.name} discarded: {problem}; re-running from the one before")
            self.events.emit("checkpoint_discarded", stage=stage_id, reason=problem,
                             moved_to=relative_path(moved, self.run_dir))
            return False
        if path is None:
            return False
        result = read_result(path)
        failure = result.failure
        if result.status == "rolled_back" and failure and failure.kind in TRANSIENT_FAILURES:
            self.observers.line(f"  {stage_id}: rolled back last time for a cause that can pass "
                              f"({failure.kind}: {failure.reason}); running it again")
            self.events.emit("stage_retried_on_resume", stage=stage_id, failure=failure.as_json())
            return False
        status = "cached" if result.status == "done" else result.status
        stage = self.spec.stage(stage_id)
        gate = check_gate(stage.gate, result.metrics, self._baseline()) if status == "cached" else None
        record = StageRecord(stage_id, stage.uses, key, status, self._role(stage_id), str(path),
                             result.metrics, result.baseline, gate, result.attempt + 1, result.duration_s,
                             failure.reason if failure else "from checkpoint", list(result.warnings))
        self.records[stage_id] = record
        self.events.emit("stage_cached", stage=stage_id, key=key)
        self.observers.finished(stage_id, status, record.metrics, None, "(checkpoint reused)")
        return True

    def _baseline(self) -> dict[str, Any] | None:
        return next((r.metrics for r in self.records.values() if r.baseline), None)

    def _job(self, stage_id: str, key: str, cfg: Any, attempt: int, remedy: Any,
             incoming: Path | None, out_dir: Path) -> Job:
        upstream = [r.upstream_view() for n in ancestors(self.graph, stage_id) if (r := self.records[n]).dir]
        return Job(run_dir=self.run_dir, stage_id=stage_id, uses=self.spec.stage(stage_id).uses, key=key,
                   key_parts=self.key_parts[stage_id], config=cfg.model_dump(mode="json"), attempt=attempt,
                   remedy=remedy, incoming=incoming, upstream=upstream, out_dir=out_dir,
                   pipeline=self.run_dir / PIPELINE_FILE, base_dir=self.loaded.base_dir)

    def _execute(self, stage_id: str, key: str, final: Path, incoming: Path | None) -> None:
        stage = self.spec.stage(stage_id)
        stage_type, cfg = self.types[stage_id]
        attempt, remedy = 0, None
        while True:
            out_dir = new_temp_dir(final)
            outcome, seconds = self._attempt(stage_id, key, cfg, attempt, remedy, incoming, final, out_dir)
            metrics, failure = {}, Failure(kind=outcome.kind, reason=outcome.message)
            if outcome.kind == "ok":
                result = read_result(out_dir)
                metrics = result.metrics
                gate = check_gate(stage.gate, metrics, None if result.baseline else self._baseline())
                if gate.passed:
                    commit(out_dir, final)
                    clear_units(self.stages_dir, stage_id)  # the checkpoint holds what they were for
                    self._record(stage_id, key, "done", final, result, gate, attempt, seconds)
                    return
                failed_check = gate.first_failure()
                assert failed_check is not None  # a verdict that did not pass has a failed check
                failure = Failure.of_gate(failed_check)
            action, next_cfg, why = self._decide(stage_id, cfg, failure, attempt)
            next_remedy = _config_change(cfg, next_cfg) if next_cfg is not None else None
            restore = incoming if action == "retry" else self._restore_point(stage_id, incoming)
            self._rollback(stage_id, attempt, failure, metrics, action, next_remedy, restore, out_dir)
            self.observers.finished(stage_id, "rolled_back", metrics, seconds,
                                  f"— {failure.reason} → {action}" + (f" ({why})" if why else ""))
            if action == "retry":
                cfg, remedy, attempt = next_cfg, next_remedy, attempt + 1
                continue
            if action == "abort":
                self.records[stage_id] = StageRecord(stage_id, stage.uses, key, "failed", self._role(stage_id),
                                                     None, metrics, attempts=attempt + 1, note=failure.reason)
                raise RunFailed(f"stage '{stage_id}' failed ({failure.reason}); {why}")
            self._pass_through(stage_id, key, final, restore, attempt, failure)
            return

    def _attempt(self, stage_id: str, key: str, cfg: Any, attempt: int, remedy: Any, incoming: Path | None,
                 final: Path, out_dir: Path) -> tuple[WorkerOutcome, float]:
        """One supervised worker run of the stage; a disk too full for its checkpoint stops it first."""
        stage = self.spec.stage(stage_id)
        self.events.emit("stage_started", stage=stage_id, key=key, attempt=attempt, remedy=remedy)
        self.observers.started(stage_id, stage.uses, attempt)
        started = time.monotonic()
        try:  # before hours of compute, not after: the checkpoint is about the size of the model
            needed = self._checkpoint_estimate(stage_id, incoming)
            check_free_disk(self.stages_dir, needed, self.spec.run.min_free_disk_mb)
        except DiskSpaceError as exc:
            return WorkerOutcome("disk", str(exc)), 0.0
        threads = self._threads(stage_id)
        env = {"OMP_NUM_THREADS": str(threads), STAGE_THREADS: str(threads)} if threads else {}
        job = self._job(stage_id, key, cfg, attempt, remedy, incoming, out_dir)
        outcome = run_worker(
            job, out_dir / JOB_FILE, self.run_dir / "logs" / f"{final.name}.log",
            stall_timeout_s=self.spec.run.stall_timeout_s, compile_timeout_s=self.spec.run.compile_timeout_s,
            timeout_s=stage.timeout_s or self.spec.run.stage_timeout_s,
            on_message=lambda m, s=stage_id: self._on_message(s, m), env=env)
        return outcome, time.monotonic() - started

    def _threads(self, stage_id: str) -> int | None:
        """The stage worker's thread count: ``run.threads``, or for "auto" the cores idle right now."""
        setting = self.spec.run.threads
        if setting != "auto":
            return setting
        threads, idle, cores = auto_threads()
        self.observers.line(f"  {stage_id}: {threads} thread{'s' if threads > 1 else ''} "
                          f"({idle:.1f} of {cores} cores idle; run.threads: auto)")
        self.events.emit("stage_threads", stage=stage_id, threads=threads, idle_cores=round(idle, 2), cores=cores)
        return threads

    def _on_message(self, stage_id: str, message: dict[str, Any]) -> None:
        if message.get("t") == "event" and isinstance(message.get("fields"), dict):
            self.events.emit(str(message.get("event")), stage=stage_id, **message["fields"])
        self.observers.update(stage_id, message)

    def _checkpoint_estimate(self, stage_id: str, incoming: Path | None) -> int:
        if self._role(stage_id) not in ("transform", "export"):
            return 0
        return estimate_checkpoint_bytes(incoming) or self.base_model_bytes

    def _decide(self, stage_id: str, cfg: Any, failure: Failure, attempt: int) -> tuple[str, Any, str]:
        """``(action, config of the next attempt, why)`` after a failed attempt: retry, skip or abort."""
        stage = self.spec.stage(stage_id)
        stage_type = self.types[stage_id][0]
        if failure.kind == "disk":
            return "abort", None, DISK_FULL
        if self._role(stage_id) == "baseline":
            return "abort", None, "the baseline cannot be skipped: without it no ratio means anything"
        if failure.kind == "input":  # bad input or an unsupported operation repeats on every attempt
            return ("skip", None, "not retried: it cannot change") if stage.on_fail == "skip" else (
                "abort", None, "not retried: the failure cannot change on retry")
        if stage.on_fail != "retry":
            return stage.on_fail, None, "" if stage.on_fail == "skip" else "on_fail is abort"
        max_retries = stage.retries if stage.retries is not None else self.spec.run.max_retries
        next_cfg = stage_type.remedy(cfg, failure) if failure.kind == "gate" else cfg
        if attempt < max_retries and next_cfg is not None:
            return "retry", next_cfg, ""
        return "abort", None, ("on_fail is retry and the retries are used up" if next_cfg is not None
                               else "on_fail is retry and the stage has no remedy left")

    def _restore_point(self, stage_id: str, incoming: Path | None) -> Path | None:
        """The checkpoint a rolled-back stage passes on: never a model a check has rejected.

        A stage that changes or plans the model failed on its own output: its input stands. A stage
        that only measures or exports failed on the model it was given, which may be the culprit, so
        go back to the last checkpoint whose model was verified (gates passed, accuracy finite).
        """
        if self._role(stage_id) in ("transform", "analysis"):
            return incoming
        needs = self.spec.stage(stage_id).needs
        while needs:
            record = self.records[needs[-1]]
            if record.status in KEPT and (record.baseline or verified(record.gate)):
                return Path(record.dir)
            needs = self.spec.stage(record.id).needs
        return None

    def _record(self, stage_id: str, key: str, status: str, final: Path, result: ResultRecord,
                gate: GateVerdict | None, attempt: int, seconds: float | None, note: str = "") -> None:
        stage = self.spec.stage(stage_id)
        record = StageRecord(stage_id, stage.uses, key, status, self._role(stage_id), str(final), result.metrics,
                             result.baseline, gate, attempt + 1, round(seconds, 3) if seconds else None, note,
                             list(result.warnings))
        self.records[stage_id] = record
        self.events.emit("stage_" + status, stage=stage_id, key=key, metrics=record.metrics,
                         gate=gate.as_json() if gate else None, attempts=attempt + 1, warnings=record.warnings)
        if status == "done":
            self.observers.finished(stage_id, status, record.metrics, seconds,
                                  "".join(f"— warning: {w}" for w in record.warnings[:1]))

    def _rollback(self, stage_id: str, attempt: int, failure: Failure, metrics: dict[str, Any],
                  action: str, remedy: Any, restored: Path | None, out_dir: Path) -> None:
        rejected = move_aside(out_dir, self.run_dir / "rejected", f"-{stage_id}-attempt{attempt}")
        drop_tensors(rejected)
        record = {
            "stage": stage_id, "attempt": attempt, "kind": failure.kind, "metric": failure.metric,
            "bound": failure.bound, "threshold": failure.threshold, "measured": failure.measured,
            "baseline": failure.baseline, "reason": failure.reason,
            "remedy": remedy if remedy is not None else "none",
            "action": action, "restored": restored.name if restored else "base model",
            "evidence": str(rejected.relative_to(self.run_dir)), "time": round(time.time(), 3),
        }
        self.rollbacks.append(record)
        self.events.emit("rollback", **record)

    def _pass_through(self, stage_id: str, key: str, final: Path, restored: Path | None, attempt: int,
                      failure: Failure) -> None:
        """Commit the restored state under this stage, with the failure, so resume knows what happened."""
        out_dir = new_temp_dir(final)
        result = ResultRecord(status="rolled_back", attempt=attempt, failure=failure)
        write_checkpoint(out_dir, key=key, key_parts=self.key_parts[stage_id], stage_id=stage_id,
                         uses=self.spec.stage(stage_id).uses, state=read_state(restored, self.spec), result=result,
                         inherit_tensors_from=restored, reserve_mb=self.spec.run.min_free_disk_mb)
        commit(out_dir, final)
        self._record(stage_id, key, "rolled_back", final, result, None, attempt, None, failure.reason)


def _config_change(old: Any, new: Any) -> dict[str, Any]:
    before, after = old.model_dump(mode="json"), new.model_dump(mode="json")
    changed = {k: {"from": before.get(k), "to": v} for k, v in after.items() if before.get(k) != v}
    return changed or {"retry": "same configuration"}
