"""Where a running pipeline stands: per-stage progress, ETAs, and the run's progress.json.

The engine's side of progress: ``ProgressFile`` is the observer the runner always has, whatever shows
the run (a terminal, a log, nothing for the Python API); it keeps run_dir/progress.json for ``opus
status``. No rich here: the displays (opus.cli.run_display, opus.bench.display) format with the same
helpers. ETAs come only from measured rates and measured durations; where nothing has been measured
yet they are ``None`` (shown as ``?``), never a guess.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opus.atomic import write_json
from opus.pipeline.events import Unobserved

PROGRESS_FILE = "progress.json"
# progress.json is rewritten on every stage start/finish and at most this often in between: each
# write fsyncs, and `opus status` needs seconds of freshness, not milliseconds.
PROGRESS_FILE_INTERVAL_S = 2.0


class Ticker:
    """Calls ``tick`` every ``period_s`` on a daemon thread until stopped: progress.json and a log's
    lines must come even while a stage sends no message (a long phase)."""

    def __init__(self, period_s: float, tick: Callable[[], None]) -> None:
        self.period_s, self.tick = period_s, tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="opus-progress", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.tick()


def format_duration(seconds: float | None) -> str:
    """``1:05``, ``2:03:04``; ``?`` when unknown."""
    if seconds is None:
        return "?"
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _number(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


def format_count(done: float | None, total: float | None) -> str:
    """``12/40 30%``; ``12`` when the total is unknown; ``-`` before any progress."""
    if done is None:
        return "-"
    if not total:
        return _number(done)
    return f"{_number(done)}/{_number(total)} {min(100.0, 100 * done / total):.0f}%"


@dataclass
class StageProgress:
    """One running stage attempt, as its worker reported it."""

    stage_id: str
    uses: str
    attempt: int
    started: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    done: float | None = None
    total: float | None = None
    what: str = "starting"
    # (time, done) of the first counted message: the rate excludes start-up (loading the model),
    # which says nothing about how fast the remaining units go.
    anchor: tuple[float, float] | None = None
    last_printed: float = field(default_factory=time.monotonic)
    # Since when torch has been compiling (opus.compile_watch); None when it is not.
    compiling_since: float | None = None

    def observe(self, message: dict[str, Any], now: float) -> None:
        self._compiling(message.get("compiling"), now)
        done, total = message.get("done"), message.get("total")
        self.what = str(message.get("what") or self.what)
        self.total = float(total) if isinstance(total, (int, float)) and total > 0 else None
        if not isinstance(done, (int, float)):
            return
        if self.anchor is None or done < self.anchor[1]:  # a phase that counts from zero again
            self.anchor = (now, float(done))
        self.done = float(done)

    def _compiling(self, flag: object, now: float) -> None:
        if flag is True and self.compiling_since is None:
            self.compiling_since = now
        elif flag is False:
            self.compiling_since = None

    def label(self, now: float) -> str:
        """The phase, and how long torch has been compiling when it is."""
        if self.compiling_since is None:
            return self.what
        return f"{self.what} · compiling {format_duration(now - self.compiling_since)}"

    def eta_s(self, now: float) -> float | None:
        """Remaining seconds at the rate measured since the first counted message; unknown while torch
        compiles: a compile of minutes advances no unit, and the rate then fell by the minute (an ETA of 35
        hours for a stage that took 11 minutes). The compiles that ended are in the rate: more may come."""
        if self.total is None or self.done is None or self.anchor is None or self.compiling_since is not None:
            return None  # compiling: also after a phase's last unit (the plan's check compiles its next model)
        if self.done >= self.total:
            return 0.0
        since, first = self.anchor
        if self.done <= first or now <= since:
            return None
        return (now - since) / (self.done - first) * (self.total - self.done)


@dataclass
class RunEta:
    seconds: float | None
    estimated: bool  # includes stages not started yet, at the mean duration of the stages that ran

    def text(self) -> str:
        return ("~" if self.estimated and self.seconds is not None else "") + format_duration(self.seconds)


class RunProgress:
    """The run's stages: which run, which finished (and how long they took), the run's ETA."""

    def __init__(self) -> None:
        self.order: list[str] | None = None  # unknown until begin(): then the run's ETA stays "?"
        self.running: dict[str, StageProgress] = {}
        self.finished: dict[str, dict[str, Any]] = {}

    def begin(self, stage_ids: list[str]) -> None:
        self.order = list(stage_ids)

    def start(self, stage_id: str, uses: str, attempt: int) -> StageProgress:
        self.finished.pop(stage_id, None)  # a retry runs the stage again
        stage = StageProgress(stage_id, uses, attempt)
        self.running[stage_id] = stage
        return stage

    def observe(self, stage_id: str, message: dict[str, Any], now: float) -> StageProgress | None:
        """A worker's progress message for a running stage; None for other messages or stages."""
        stage = self.running.get(stage_id)
        if stage is None or message.get("t") != "progress":
            return None
        stage.observe(message, now)
        return stage

    def finish(self, stage_id: str, status: str, seconds: float | None) -> None:
        self.running.pop(stage_id, None)
        self.finished[stage_id] = {"status": status, "seconds": seconds}

    def run_eta(self, now: float) -> RunEta:
        """The running stages' remaining time plus, for stages not started, the mean duration of the
        stages that ran in this process (cached ones took no time and say nothing)."""
        if self.order is None:
            return RunEta(None, False)
        # Copies: the live display renders this on its own thread while stages start and finish
        # (list() of a dict view is one step under the GIL; a lock here could deadlock with rich's).
        running, finished = list(self.running.values()), list(self.finished.values())
        current = [s.eta_s(now) for s in running]
        if any(eta is None for eta in current):
            return RunEta(None, False)
        waiting = [s for s in self.order if s not in self.finished and s not in self.running]
        if not waiting:
            return RunEta(sum(current), False)  # type: ignore[arg-type]  # None excluded above
        durations = [f["seconds"] for f in finished if f["seconds"] is not None]
        if not durations:
            return RunEta(None, False)
        mean = sum(durations) / len(durations)
        return RunEta(sum(current) + mean * len(waiting), True)  # type: ignore[arg-type]

    def snapshot(self, now: float) -> dict[str, Any]:
        run_eta = self.run_eta(now)
        return {
            "updated": time.time(), "pid": os.getpid(), "stages": self.order,
            "running": [{"stage": s.stage_id, "uses": s.uses, "attempt": s.attempt, "started": s.started_wall,
                         "done": s.done, "total": s.total, "what": s.label(now), "eta_s": s.eta_s(now)}
                        for s in self.running.values()],
            "finished": self.finished, "run_eta_s": run_eta.seconds, "run_eta_estimated": run_eta.estimated,
        }



class ProgressFile(Unobserved):  # line and warn: words are the display's
    """The runner's own observer (opus.pipeline.events.RunObserver): keeps run_dir/progress.json.

    ``update`` runs on the worker listener's thread, the rest on the main thread, the periodic write on
    a ticker thread: the state is shared under one lock.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / PROGRESS_FILE
        self.run = RunProgress()
        self._lock = threading.Lock()
        self._written = 0.0
        # A stage may go quiet for long after its last message: ETAs and `updated` still move on.
        self._ticker = Ticker(1.0, lambda: self._save(force=False))

    def __enter__(self) -> ProgressFile:
        self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ticker.stop()
        with self._lock:
            self.run.running.clear()  # also after Ctrl-C: an interrupted stage is not running any more
        self._save(force=True)

    def begin(self, stage_ids: list[str]) -> None:
        with self._lock:
            self.run.begin(stage_ids)
        self._save(force=True)

    def started(self, stage_id: str, uses: str, attempt: int) -> None:
        with self._lock:
            self.run.start(stage_id, uses, attempt)
        self._save(force=True)

    def update(self, stage_id: str, message: dict[str, Any]) -> None:
        with self._lock:
            changed = self.run.observe(stage_id, message, time.monotonic()) is not None
        if changed:
            self._save(force=False)

    def finished(self, stage_id: str, status: str, metrics: dict[str, Any], seconds: float | None,
                 note: str = "") -> None:
        with self._lock:
            self.run.finish(stage_id, status, seconds)
        self._save(force=True)

    def _save(self, force: bool) -> None:
        """Write progress.json (atomically), at most every PROGRESS_FILE_INTERVAL_S unless forced."""
        now = time.monotonic()
        with self._lock:
            if not force and now - self._written < PROGRESS_FILE_INTERVAL_S:
                return
            self._written = now
            snapshot = self.run.snapshot(now)
            try:
                write_json(self.path, snapshot)
            except OSError:
                pass  # progress.json is a convenience for `opus status`; a full disk must not stop the run


def describe_running(entry: dict[str, Any], now_wall: float) -> str:
    """One running stage from progress.json, as ``opus status`` prints it."""
    label = entry["stage"] + (f" retry {entry['attempt']}" if entry.get("attempt") else "")
    return (f"{label} ({entry.get('uses', '?')}): {entry.get('what', '')}  "
            f"{format_count(entry.get('done'), entry.get('total'))}  "
            f"elapsed {format_duration(now_wall - entry['started'])}  "
            f"stage ETA {format_duration(entry.get('eta_s'))}")
