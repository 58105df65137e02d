"""The runner: validated DAG -> one supervised worker per stage -> checkpoint -> gate -> next.

A stage is finished when its checkpoint is committed; resume re-runs nothing finished whose key
still matches. A failed gate, crash or hang rolls back to the incoming checkpoint and follows the
stage's ``on_fail``: retry with the stage's remedy, skip (continue from the previous checkpoint), or
abort.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opus.atomic import read_json, write_json, write_yaml
from opus.checkpoint import (
    clean_temporaries,
    commit,
    drop_tensors,
    move_aside,
    new_temp_dir,
    read_manifest,
    read_result,
    verify_checkpoint,
    write_checkpoint,
)
from opus.console import RunDisplay
from opus.errors import RunFailed
from opus.events import EventLog
from opus.gates import check_gate, first_failure
from opus.graph import ancestors, execution_order, validate
from opus.keys import run_context_fingerprint, stage_key
from opus.lock import RunLock
from opus.spec import LoadedPipeline
from opus.state import read_state
from opus.summary import build_summary
from opus.supervise import run_worker

RUN_FILE = "run.json"
PIPELINE_FILE = "pipeline.yaml"
SUMMARY_FILE = "summary.json"


@dataclass
class StageRecord:
    id: str
    uses: str
    key: str
    status: str  # done | cached | rolled_back | failed | skipped
    dir: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    baseline: bool = False
    gate: dict[str, Any] | None = None
    attempts: int = 0
    duration_s: float | None = None
    note: str = ""


class Runner:
    def __init__(self, loaded: LoadedPipeline, run_dir: Path, display: RunDisplay) -> None:
        self.loaded, self.spec = loaded, loaded.spec
        self.graph, self.types = validate(loaded)
        self.run_dir = run_dir.resolve()
        self.stages_dir = self.run_dir / "stages"
        self.events = EventLog(self.run_dir)
        self.display = display
        self.records: dict[str, StageRecord] = {}
        self.rollbacks: list[dict[str, Any]] = []

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        with RunLock(self.run_dir):
            resumed = self._prepare()
            self.events.emit("run_resumed" if resumed else "run_started", pid=os.getpid())
            status, error = "finished", None
            order = execution_order(self.graph)
            try:
                for stage_id in order:
                    self._run_stage(stage_id)
            except KeyboardInterrupt:
                status, error = "interrupted", "stopped by the user; `opus resume` continues"
            except RunFailed as exc:
                status, error = "aborted", str(exc)
            for stage_id in order:
                if stage_id not in self.records:
                    stage = self.spec.stage(stage_id)
                    self.records[stage_id] = StageRecord(stage_id, stage.uses, "", "skipped")
            summary = build_summary(self.run_dir.name, status, [asdict(r) for r in self.records.values()],
                                    self.rollbacks, error)
            write_json(self.run_dir / SUMMARY_FILE, summary)
            self.events.emit("run_" + status, error=error)
            return summary

    def _prepare(self) -> bool:
        self.stages_dir.mkdir(parents=True, exist_ok=True)
        for path in clean_temporaries(self.stages_dir):
            self.events.emit("temporary_removed", path=path.name)
        write_yaml(self.run_dir / PIPELINE_FILE, self.loaded.raw)
        run_file = self.run_dir / RUN_FILE
        info = read_json(run_file) if run_file.is_file() else {
            "run_id": self.run_dir.name, "created": time.time(), "host": socket.gethostname(),
            "starts": []}
        info.update(pipeline=str(self.loaded.path.resolve()), base_dir=str(self.loaded.base_dir),
                    name=self.spec.name)
        info["starts"].append(time.time())
        write_json(run_file, info)
        self.context = run_context_fingerprint(self.spec, self.loaded.base_dir)
        return len(info["starts"]) > 1

    # -- one stage -------------------------------------------------------------------------
    def _run_stage(self, stage_id: str) -> None:
        stage = self.spec.stage(stage_id)
        stage_type, cfg = self.types[stage_id]
        input_keys = {n: self.records[n].key for n in stage.needs}
        key = stage_key(stage, stage_type, cfg, input_keys, self.context)
        index = self.graph.nodes[stage_id]["index"]
        final = self.stages_dir / f"{index:02d}-{stage_id}"
        if self._reuse(stage_id, key):
            return
        incoming = Path(self.records[stage.needs[-1]].dir) if stage.needs else None
        self._execute(stage_id, key, final, incoming)

    def _reuse(self, stage_id: str, key: str) -> bool:
        found = sorted(self.stages_dir.glob(f"[0-9][0-9]-{stage_id}"))
        for path in found:
            if read_manifest_key(path) != key:
                continue  # stale: a parameter or an input changed; replaced when the stage commits
            reason = verify_checkpoint(path)
            if reason:
                moved = move_aside(path, self.run_dir / "discarded")
                self.display.warn(f"checkpoint {path.name} discarded: {reason}; re-running from the one before")
                self.events.emit("checkpoint_discarded", stage=stage_id, reason=reason, moved_to=str(moved))
                return False
            result = read_result(path)
            status = "cached" if result["status"] == "done" else result["status"]
            gate = check_gate(self.spec.stage(stage_id).gate, result["metrics"], self._baseline())
            record = StageRecord(stage_id, self.spec.stage(stage_id).uses, key, status, str(path),
                                 result["metrics"], result.get("baseline", False), gate,
                                 result.get("attempt", 0) + 1, result.get("duration_s"), "from checkpoint")
            self.records[stage_id] = record
            self.events.emit("stage_cached", stage=stage_id, key=key)
            self.display.finished(stage_id, status, record.metrics, None, "(checkpoint reused)")
            return True
        return False

    def _baseline(self) -> dict[str, Any] | None:
        return next((r.metrics for r in self.records.values() if r.baseline), None)

    def _job(self, stage_id: str, key: str, cfg: Any, attempt: int, remedy: Any,
             incoming: Path | None, out_dir: Path) -> dict[str, Any]:
        upstream = [{"id": r.id, "uses": r.uses, "key": r.key, "status": r.status, "metrics": r.metrics,
                     "dir": r.dir, "baseline": r.baseline}
                    for n in ancestors(self.graph, stage_id) if (r := self.records[n]).dir]
        return {"run_dir": str(self.run_dir), "stage_id": stage_id, "uses": self.spec.stage(stage_id).uses,
                "key": key, "config": cfg.model_dump(mode="json"), "attempt": attempt, "remedy": remedy,
                "incoming": str(incoming) if incoming else None, "upstream": upstream,
                "out_dir": str(out_dir), "pipeline": str(self.run_dir / PIPELINE_FILE),
                "base_dir": str(self.loaded.base_dir)}

    def _execute(self, stage_id: str, key: str, final: Path, incoming: Path | None) -> None:
        stage = self.spec.stage(stage_id)
        stage_type, cfg = self.types[stage_id]
        max_retries = stage.retries if stage.retries is not None else self.spec.run.max_retries
        env = {"OMP_NUM_THREADS": str(self.spec.run.threads)} if self.spec.run.threads else {}
        attempt, remedy = 0, None
        while True:
            out_dir = new_temp_dir(final)
            job = self._job(stage_id, key, cfg, attempt, remedy, incoming, out_dir)
            self.events.emit("stage_started", stage=stage_id, key=key, attempt=attempt, remedy=remedy)
            self.display.started(stage_id, stage.uses, attempt)
            started = time.monotonic()
            outcome = run_worker(
                job, out_dir / "job.json", self.run_dir / "logs" / f"{final.name}.log",
                stall_timeout_s=self.spec.run.stall_timeout_s,
                timeout_s=stage.timeout_s or self.spec.run.stage_timeout_s,
                on_message=lambda m, s=stage_id: self.display.update(s, m), env=env)
            seconds = time.monotonic() - started
            if outcome.kind == "disk":
                shutil.rmtree(out_dir, ignore_errors=True)
                self.display.finished(stage_id, "failed", {}, seconds, outcome.message)
                raise RunFailed(f"stage '{stage_id}': {outcome.message}; previous checkpoints are intact")
            metrics, failure = {}, {"kind": outcome.kind, "reason": outcome.message}
            if outcome.kind == "ok":
                result = read_result(out_dir)
                metrics = result["metrics"]
                gate = check_gate(stage.gate, metrics, None if result.get("baseline") else self._baseline())
                if gate["passed"]:
                    commit(out_dir, final)
                    self._record(stage_id, key, "done", final, result, gate, attempt, seconds)
                    return
                failure = {"kind": "gate", **first_failure(gate)}
            next_cfg = None
            if stage.on_fail == "retry" and attempt < max_retries:
                next_cfg = stage_type.remedy(cfg, failure) if failure["kind"] == "gate" else cfg
            action = "retry" if next_cfg is not None else ("abort" if stage.on_fail == "abort" else "skip")
            next_remedy = _config_change(cfg, next_cfg) if next_cfg is not None else None
            self._rollback(stage_id, attempt, failure, metrics, action, next_remedy, incoming, out_dir)
            self.display.finished(stage_id, "rolled_back", metrics, seconds, f"— {failure['reason']} → {action}")
            if next_cfg is not None:
                cfg, remedy, attempt = next_cfg, next_remedy, attempt + 1
                continue
            if action == "abort":
                self.records[stage_id] = StageRecord(stage_id, stage.uses, key, "failed", None, metrics,
                                                     attempts=attempt + 1, note=failure["reason"])
                raise RunFailed(f"stage '{stage_id}' failed ({failure['reason']}) and on_fail is abort")
            self._pass_through(stage_id, key, final, incoming, attempt, failure)
            return

    def _record(self, stage_id: str, key: str, status: str, final: Path, result: dict[str, Any],
                gate: dict[str, Any] | None, attempt: int, seconds: float | None, note: str = "") -> None:
        stage = self.spec.stage(stage_id)
        record = StageRecord(stage_id, stage.uses, key, status, str(final), result["metrics"],
                             result.get("baseline", False), gate, attempt + 1,
                             round(seconds, 3) if seconds else None, note)
        self.records[stage_id] = record
        self.events.emit("stage_" + status, stage=stage_id, key=key, metrics=record.metrics,
                         gate=gate, attempts=attempt + 1)
        if status == "done":
            self.display.finished(stage_id, status, record.metrics, seconds)

    def _rollback(self, stage_id: str, attempt: int, failure: dict[str, Any], metrics: dict[str, Any],
                  action: str, remedy: Any, incoming: Path | None, out_dir: Path) -> None:
        rejected = move_aside(out_dir, self.run_dir / "rejected", f"-{stage_id}-attempt{attempt}")
        drop_tensors(rejected)
        record = {
            "stage": stage_id, "attempt": attempt, "kind": failure["kind"],
            "metric": failure.get("metric"), "bound": failure.get("bound"),
            "threshold": failure.get("threshold"), "measured": failure.get("measured"),
            "baseline": failure.get("baseline"), "reason": failure["reason"],
            "remedy": remedy if remedy is not None else "none",
            "action": action, "restored": incoming.name if incoming else "base model",
            "evidence": str(rejected.relative_to(self.run_dir)),
        }
        self.rollbacks.append(record)
        self.events.emit("rollback", **record)

    def _pass_through(self, stage_id: str, key: str, final: Path, incoming: Path | None, attempt: int,
                      failure: dict[str, Any]) -> None:
        """Commit the incoming state unchanged under this stage, so resume does not redo the failure."""
        out_dir = new_temp_dir(final)
        result = {"status": "rolled_back", "metrics": {}, "baseline": False, "attempt": attempt,
                  "failure": failure}
        write_checkpoint(out_dir, key=key, stage_id=stage_id, uses=self.spec.stage(stage_id).uses,
                         state=read_state(incoming, self.spec), result=result,
                         inherit_tensors_from=incoming, reserve_mb=self.spec.run.min_free_disk_mb)
        commit(out_dir, final)
        self._record(stage_id, key, "rolled_back", final, result, None, attempt, None, failure["reason"])


def read_manifest_key(path: Path) -> str | None:
    try:
        return read_manifest(path).get("key")
    except (OSError, ValueError):
        return None


def _config_change(old: Any, new: Any) -> dict[str, Any]:
    before, after = old.model_dump(mode="json"), new.model_dump(mode="json")
    changed = {k: {"from": before.get(k), "to": v} for k, v in after.items() if before.get(k) != v}
    return changed or {"retry": "same configuration"}
