"""Models timed side by side: interleaved rounds in one process, a ratio with its interval per model.

A ratio of two figures measured minutes or hours apart measures the machine as much as the models
(another process, a thermal state, a neighbour's job). Here every model is in memory and each round
times each of them once, back to back, in rotated order — round ``r`` starts at side ``r mod N``
(for two: B C, C B, ...) — so a slow moment hits them all and no side always runs first or last.
Each round gives one ratio side / baseline (side 0) per timed quantity, and the result is their
median with the interval [min, max] over the rounds. An interval wider than ``MAX_WIDTH`` of the
ratio is measured again once with as many rounds; still too wide, it is marked ``noisy``. Gates on a
ratio use the interval's conservative end (``opus.pipeline.gates``), so a noisy measurement cannot
pass a speed gate by luck.

``measure_paired`` is the two-model case the eval stage uses (P and D of the baseline and the
candidate); ``measure_interleaved`` is the general one (``opus bench``: N contenders, any figures a
round's run returns). ``measure_bracketed`` is the eval stage's fallback when the two models do not
fit in memory together: baseline, candidate, baseline, one model loaded at a time, the two baseline
runs bracketing the candidate's and their drift reported.

Stored beside the metric as ``<key>_paired``: ``{"ratio", "low", "high", "n", "noisy", "baseline",
"candidate", "ratios"}`` (medians of each side's rounds under ``baseline`` / ``candidate``), and
``"repeated": True`` when the rounds were measured a second time; bracketed, also ``"method":
"bracketed"`` and ``"drift"`` (the second baseline run over the first, less 1).
"""

from __future__ import annotations

import gc
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from opus.runtime.engine import generate
from opus.runtime.noise import paired_key

MAX_WIDTH = 0.15  # (high - low) / ratio beyond which the pairs disagree too much to trust
MIN_ROUNDS = 5  # [min, max] of 5 paired ratios leaves out each side's luck with probability 1 - 2/2**5
CacheFactory = Callable[[int, int], Any]
Advance = Callable[[str], None]
Figures = dict[str, Any]  # what one side's run in one round measured: key -> value
Table = list[list[Figures]]  # table[round][side]


def _p(model: nn.Module, prompts: torch.Tensor, output_len: int, factory: CacheFactory) -> float:
    return generate(model, prompts, output_len, factory).tok_s


def _d(model: nn.Module, prompts: torch.Tensor, _: int, factory: CacheFactory) -> float:
    return generate(model, prompts[:1], 1, factory).ttft_s * 1000


MEASURES: dict[str, Callable[[nn.Module, torch.Tensor, int, CacheFactory], float]] = {
    "throughput_tok_s": _p, "ttft_ms": _d}


def rotation(index: int, sides: int) -> list[int]:
    """The order of round ``index``: every side once, starting at side ``index mod sides``."""
    first = index % sides
    return [*range(first, sides), *range(first)]


def interleaved_rounds(run: Callable[[int], Figures], sides: int, rounds: int, start: int = 0,
                       advance: Advance | None = None, what: str = "") -> Table:
    """``rounds`` rounds numbered from ``start``; in each, ``run(side)`` once per side in rotated order."""
    table = []
    for index in range(start, start + rounds):
        row: list[Figures] = [{} for _ in range(sides)]
        for side in rotation(index, sides):
            row[side] = run(side)
            if advance is not None:
                advance(what)
        table.append(row)
    return table


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def ratio_interval(pairs: Sequence[tuple[float, float]]) -> dict[str, Any] | None:
    """Median and [min, max] of the per-round ratios candidate / baseline; None without a valid pair."""
    pairs = [(b, c) for b, c in pairs if _number(b) and _number(c) and b > 0]
    if not pairs:
        return None
    ratios = [c / b for b, c in pairs]
    ratio = statistics.median(ratios)
    low, high = min(ratios), max(ratios)
    return {"ratio": ratio, "low": low, "high": high, "n": len(ratios),
            "noisy": (high - low) > MAX_WIDTH * abs(ratio),
            "baseline": statistics.median(b for b, _ in pairs), "candidate": statistics.median(c for _, c in pairs),
            "ratios": [round(r, 5) for r in ratios]}


def interleaved_ratios(table: Table, keys: Sequence[str]) -> dict[str, list[dict[str, Any] | None]]:
    """``{key: [interval of side 1 / side 0, of side 2 / side 0, ...]}``: pairs from the same round only."""
    sides = len(table[0]) if table else 0
    return {key: [ratio_interval([(row[0].get(key), row[side].get(key)) for row in table])
                  for side in range(1, sides)] for key in keys}


def any_noisy(summaries: dict[str, list[dict[str, Any] | None]]) -> bool:
    return any(s is not None and s["noisy"] for per in summaries.values() for s in per)


def measure_interleaved(run: Callable[[int], Figures], sides: int, keys: Sequence[str], rounds: int,
                        advance: Advance | None = None,
                        what: str = "") -> tuple[Table, dict[str, list[dict[str, Any] | None]]]:
    """At least ``MIN_ROUNDS`` interleaved rounds of ``run`` over ``sides`` sides (side 0 the baseline),
    and each other side's ratio interval for each of ``keys``. When any interval is wider than
    ``MAX_WIDTH``, every side is measured again for as many rounds (the order keeps rotating) and the
    intervals cover both; each is then marked ``repeated``, and ``noisy`` where still too wide."""
    rounds = max(rounds, MIN_ROUNDS)
    table = interleaved_rounds(run, sides, rounds, 0, advance, what)
    summaries = interleaved_ratios(table, keys)
    if any_noisy(summaries):  # once more: a burst of another process may have hit a few rounds
        table += interleaved_rounds(run, sides, rounds, rounds, advance, what)
        summaries = {key: [None if s is None else {**s, "repeated": True} for s in per]
                     for key, per in interleaved_ratios(table, keys).items()}
    return table, summaries


def paired_units(keys: list[str], rounds: int) -> int:
    """Progress units ``measure_paired`` reports at most (warm-up, rounds, and one repeat of them)."""
    return len(keys) * 2 * (1 + 2 * max(rounds, MIN_ROUNDS))


def measure_paired(baseline: tuple[nn.Module, CacheFactory], candidate: tuple[nn.Module, CacheFactory],
                   prompts: torch.Tensor, output_len: int, keys: list[str], rounds: int,
                   advance: Advance | None = None) -> dict[str, dict[str, Any]]:
    """``{paired_key(key): {...}}`` for each of ``keys`` (``throughput_tok_s``, ``ttft_ms``)."""
    advance = advance or (lambda _: None)
    sides = [baseline, candidate]
    out = {}
    for key in keys:
        measure = MEASURES[key]
        for model, factory in sides:  # a warm-up each: one-time work lands in no round
            measure(model, prompts, output_len, factory)
            advance(f"{key} side by side warm-up")

        def run(side: int, key: str = key, measure: Callable[..., float] = measure) -> Figures:
            model, factory = sides[side]
            return {key: measure(model, prompts, output_len, factory)}

        _, summaries = measure_interleaved(run, 2, [key], rounds, advance, f"{key} side by side")
        if summaries[key][0] is not None:
            out[paired_key(key)] = summaries[key][0]
    return out


Loader = Callable[[], tuple[nn.Module, CacheFactory]]


def _one_side(load: Loader, prompts: torch.Tensor, output_len: int, keys: Sequence[str], repeats: int,
              advance: Advance, what: str) -> Figures:
    """Load one model, time each key (a warm-up, then the median of ``repeats``), and let it go."""
    model, factory = load()
    figures: Figures = {}
    for key in keys:
        measure = MEASURES[key]
        measure(model, prompts, output_len, factory)
        figures[key] = statistics.median(measure(model, prompts, output_len, factory) for _ in range(repeats))
        advance(f"{key} {what}")
    del model, factory
    gc.collect()
    return figures


def measure_bracketed(load_baseline: Loader, load_candidate: Loader, prompts: torch.Tensor, output_len: int,
                      keys: list[str], repeats: int, advance: Advance | None = None) -> dict[str, dict[str, Any]]:
    """Baseline, candidate, baseline — one model in memory at a time — for each of ``keys``: the ratio
    to the mean of the two baseline runs, its interval the candidate against each of them. A drift
    wider than ``MAX_WIDTH`` brackets once more; still too wide, the ratio is marked ``noisy``."""
    advance = advance or (lambda _: None)
    repeats = max(repeats, MIN_ROUNDS)

    def bracket() -> dict[str, dict[str, Any]]:
        runs = [_one_side(load, prompts, output_len, keys, repeats, advance, what)
                for load, what in ((load_baseline, "baseline (1/2)"), (load_candidate, "candidate"),
                                   (load_baseline, "baseline (2/2)"))]
        out = {}
        for key in keys:
            first, candidate, second = (run[key] for run in runs)
            interval = ratio_interval([(first, candidate), (second, candidate)])
            if interval is not None:
                out[paired_key(key)] = {**interval, "method": "bracketed", "drift": second / first - 1}
        return out

    out = bracket()
    if any(s["noisy"] for s in out.values()):  # the machine moved while one side ran: once more
        out = {k: {**s, "repeated": True} for k, s in bracket().items()}
    return out


def bracketed_units(keys: list[str]) -> int:
    """Progress units ``measure_bracketed`` reports at most (three sides, and one repeat of them)."""
    return len(keys) * 3 * 2
