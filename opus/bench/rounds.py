"""``opus bench``'s timing: every contender built and kept, then timed in interleaved rounds.

A ratio of two figures measured minutes apart measures the machine as much as the contenders. So
the contenders of a group are all built first (each measured once right after its build: memory,
perplexity, agreement; ``opus.bench.core.measure_once``), then timed together: one untimed warm-up
round, then ``repeats`` rounds (at least ``opus.runtime.paired.MIN_ROUNDS`` when there are ratios to
report), each running every contender once (``core.timed_run``: its P request and its D requests),
round ``r`` starting at contender ``r mod N`` so that no contender is always first or last. Each
contender's ratio to the fp32 baseline is the median of its per-round ratios with their [min, max]
(``opus.runtime.paired.measure_interleaved``, the statistics the eval stage uses for two models); a
wide interval is measured again once, then marked noisy.

When the contenders would not all fit in memory next to each other (estimated from the fp32 model's
size and each contender's share of it, against the memory available now), they are measured in
groups that fit, one after another; the fp32 baseline stays loaded and runs in every group's rounds,
so every ratio still comes from rounds in which both sides ran.
"""

from __future__ import annotations

import gc
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from opus.bench import core
from opus.bench.core import SAMPLES, TIMED_KEYS, BenchContext, Built, Contender, Row, Unavailable
from opus.export.settings import one_line
from opus.runtime.metrics import MB, Progress
from opus.runtime.noise import paired_key, spread, spread_key
from opus.runtime.paired import MIN_ROUNDS, interleaved_rounds, measure_interleaved, rotation

# What a built contender keeps resident, as a share of the fp32 model's bytes (weights it keeps, an
# ONNX graph per exported head, float embeddings beside int8 linears). A contender not listed: 1.
RESIDENT = {"fp32": 1.0, "bf16": 0.5, "torch-int8": 0.35, "w8a16": 0.35, "w4a16": 0.25, "w8a8": 0.35,
            "w8a8-tensor": 0.35, "compile": 1.0, "hf": 1.0, "onnx-fp32": 2.0, "onnx-int8": 0.7, "llama-f16": 0.5,
            "llama-q8_0": 0.3, "llama-gguf": 1.0, "llama-plan": 0.5, "opus": 1.0}
BUILD_HEADROOM = 2.0  # a build's transient copies (an fp32 load before quantizing, an export), × fp32
USABLE = 0.8  # of the memory available when the bench starts


def available_mb(device: str) -> float:
    """Memory free for more contenders now: the device's on CUDA, the machine's available RAM on CPU."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0] / MB
    import psutil

    return psutil.virtual_memory().available / MB


def resident_share(contender: Contender) -> float:
    return RESIDENT.get(contender.name, 1.0)


@dataclass
class MemoryPlan:
    groups: list[list[Contender]]  # the contenders after the baseline, group by group
    available_mb: float
    fp32_mb: float
    need_mb: float  # every contender resident at once, the baseline included, plus a build's headroom

    @property
    def grouped(self) -> bool:
        return len(self.groups) > 1


def plan_groups(contenders: list[Contender], fp32_mb: float, available: float) -> MemoryPlan:
    """Split ``contenders[1:]`` (``contenders[0]`` is the baseline, in every group) into consecutive
    groups whose estimated resident memory, with the baseline's and one build's headroom, fits
    ``USABLE`` of ``available``. A contender too big even alone gets a group of its own."""
    base, others = contenders[0], contenders[1:]
    room = USABLE * available - (BUILD_HEADROOM + resident_share(base)) * fp32_mb
    groups: list[list[Contender]] = []
    current: list[Contender] = []
    used = 0.0
    for contender in others:
        need = resident_share(contender) * fp32_mb
        if current and used + need > room:
            groups.append(current)
            current, used = [], 0.0
        current.append(contender)
        used += need
    groups.append(current)
    need = (BUILD_HEADROOM + sum(resident_share(c) for c in contenders)) * fp32_mb
    return MemoryPlan(groups, available, fp32_mb, need)


@dataclass
class Entry:
    """A contender of this bench: its row, and while it is loaded, its built model."""

    contender: Contender
    row: Row
    built: Built | None = None
    failed: bool = False  # raised during the rounds: no further runs
    timed: dict[str, Any] = field(default_factory=dict)


def _return_freed_memory() -> None:
    """glibc keeps freed heap pages; give them back so the next memory figure starts from a lower RSS."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the held figures then include more of what earlier contenders left behind


def free_memory() -> None:
    gc.collect()
    _return_freed_memory()


def build_once(contender: Contender, row: Row, ctx: BenchContext, progress: Progress, baseline: bool,
               floor_mb: float) -> Entry:
    """Build ``contender`` and measure what is measured once; the row says why when it cannot run."""
    entry = Entry(contender, row)
    started = time.monotonic()
    progress.advance(0, f"{contender.name}: preparing")
    free_memory()
    # What the contenders built before this one hold (none before the baseline).
    held = 0.0 if baseline else max(0.0, core.resident_mb(ctx.device) - floor_mb)
    built = None
    try:
        built = contender.build(ctx)
        row.notes = built.notes  # the same list: close() may add what it saw during the run
        row.metrics = core.measure_once(built, ctx, _Prefixed(progress, contender.name), baseline, held)
        entry.built = built
    except Unavailable as exc:
        row.status, row.reason = "skipped", str(exc)
    except Exception as exc:  # noqa: BLE001 - one contender's failure is a finding, not the end of the bench
        row.status, row.reason, row.detail = "failed", one_line(exc), traceback.format_exc()
    if entry.built is None and built is not None:
        close(entry, built)
    row.seconds = time.monotonic() - started
    return entry


class _Prefixed(Progress):
    """The bench's progress, each phase named with the contender it belongs to."""

    def __init__(self, progress: Progress, name: str) -> None:
        super().__init__()
        self.outer, self.name = progress, name

    def advance(self, units: float = 1, what: str | None = None) -> None:
        self.outer.advance(units, None if what is None else f"{self.name}: {what}")

    def expect(self, units: float) -> None:
        pass  # the bench's total is set once, for every contender


def close(entry: Entry, built: Built | None = None) -> None:
    built = built or entry.built
    entry.built = None
    if built is not None and built.close is not None:
        try:
            built.close()
        except Exception as exc:  # noqa: BLE001 - closing must not lose the figures already measured
            entry.row.notes.append(f"closing failed: {one_line(exc)}")
    del built
    free_memory()


def timed_rounds(repeats: int, sides: int) -> int:
    """Rounds to time: the workload's repeats, at least ``MIN_ROUNDS`` when there are ratios."""
    return max(repeats, MIN_ROUNDS) if sides > 1 else max(1, repeats)


def measure_group(entries: list[Entry], ctx: BenchContext, progress: Progress,
                  extend: Callable[[float], None] | None = None) -> dict[str, Any]:
    """Time the built ``entries`` (the baseline first) in interleaved rounds; each entry's ``timed``
    gets its figures (medians over the rounds with their spread) and, against the baseline, each
    timed ratio as ``<key>_paired``. Returns what the report says about the group's rounds."""
    sides = [e for e in entries if e.built is not None]
    names = [e.contender.name for e in sides]
    n = len(sides)
    rounds = timed_rounds(ctx.workload.repeats, n)
    requests = core.ttft_requests(rounds)
    per_run = core.round_units(ctx, requests)
    label = {"now": ""}

    def run(side: int) -> dict[str, Any]:
        entry = sides[side]
        if entry.failed:
            return {}
        try:
            return core.timed_run(entry.built, ctx, progress, requests, f"{label['now']}{entry.contender.name}")
        except Exception as exc:  # noqa: BLE001 - one contender's failure ends its rounds, not the others'
            entry.failed = True
            entry.row.status, entry.row.reason, entry.row.detail = "failed", one_line(exc), traceback.format_exc()
            return {}

    label["now"] = "warm-up round: "
    interleaved_rounds(run, n, 1)  # after the other builds, caches are cold for everyone: not timed
    calls = {"done": 0}

    def counted(side: int) -> dict[str, Any]:
        if calls["done"] == rounds * n and extend is not None:
            extend(rounds * n * per_run)  # the intervals were wide: every side runs the rounds again
        label["now"] = f"round {calls['done'] // n + 1}: "
        calls["done"] += 1
        return run(side)

    keys = list(TIMED_KEYS)
    if n > 1:
        table, summaries = measure_interleaved(counted, n, keys, rounds)
    else:
        table, summaries = interleaved_rounds(counted, n, rounds), {}
    if sides and sides[0].failed:
        return {"contenders": names, "failed": sides[0].row.reason}
    for side, entry in enumerate(sides):
        entry.timed = _figures([row[side] for row in table if row[side]])
        for key, per in summaries.items():
            if side > 0 and per[side - 1] is not None and not entry.failed:
                entry.timed[paired_key(key)] = per[side - 1]
    return {"contenders": names, "rounds": len(table), "repeated": len(table) > rounds,
            "ttft_requests_per_round": requests,
            "orders": [[names[i] for i in rotation(r, n)] for r in range(len(table))]}


def _figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A contender's timed figures over its rounds: medians with their spread (D over every request)."""
    out: dict[str, Any] = {}
    for key in TIMED_KEYS:
        values = [v for run in runs for v in (run.get(key + SAMPLES) or [run.get(key)]) if v is not None]
        if values:
            out[key] = statistics.median(values)
            out[spread_key(key)] = spread(values)
    return out
