"""Baseline and candidate timed side by side: paired rounds in one process, a ratio with its interval.

A ratio of two figures measured minutes or hours apart measures the machine as much as the models
(another process, a thermal state, a neighbour's job). Here both models are in memory and each round
times the baseline and the candidate back to back, in alternating order (B C, C B, ...), so a slow
moment hits both; each round gives one ratio candidate / baseline, and the result is their median
with the interval [min, max] over the rounds. An interval wider than ``MAX_WIDTH`` of the ratio is
measured again once with as many rounds; still too wide, it is marked ``noisy``. Gates on a ratio
use the interval's conservative end (``opus.pipeline.gates``), so a noisy measurement cannot pass a
speed gate by luck.

Stored beside the metric as ``<key>_paired``: ``{"ratio", "low", "high", "n", "noisy", "baseline",
"candidate", "ratios"}`` (medians of each side's rounds under ``baseline`` / ``candidate``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from opus.runtime.engine import generate
from opus.runtime.noise import paired_key

MAX_WIDTH = 0.15  # (high - low) / ratio beyond which the pairs disagree too much to trust
MIN_ROUNDS = 5  # [min, max] of 5 paired ratios leaves out each side's luck with probability 1 - 2/2**5
CacheFactory = Callable[[int, int], Any]
Advance = Callable[[str], None]


def _p(model: nn.Module, prompts: torch.Tensor, output_len: int, factory: CacheFactory) -> float:
    return generate(model, prompts, output_len, factory).tok_s


def _d(model: nn.Module, prompts: torch.Tensor, _: int, factory: CacheFactory) -> float:
    return generate(model, prompts[:1], 1, factory).ttft_s * 1000


MEASURES: dict[str, Callable[[nn.Module, torch.Tensor, int, CacheFactory], float]] = {
    "throughput_tok_s": _p, "ttft_ms": _d}


def _rounds(sides: list[tuple[nn.Module, CacheFactory]], measure: Callable[..., float], prompts: torch.Tensor,
            output_len: int, rounds: int, start: int, advance: Advance, what: str) -> list[tuple[float, float]]:
    pairs = []
    for index in range(start, start + rounds):
        order = (0, 1) if index % 2 == 0 else (1, 0)  # alternate, so neither side always runs second
        values = {}
        for side in order:
            model, factory = sides[side]
            values[side] = measure(model, prompts, output_len, factory)
            advance(what)
        pairs.append((values[0], values[1]))
    return pairs


def _summary(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    ratios = [c / b for b, c in pairs if b > 0]
    ratio = statistics.median(ratios)
    low, high = min(ratios), max(ratios)
    return {"ratio": ratio, "low": low, "high": high, "n": len(ratios),
            "noisy": (high - low) > MAX_WIDTH * ratio,
            "baseline": statistics.median(b for b, _ in pairs), "candidate": statistics.median(c for _, c in pairs),
            "ratios": [round(r, 5) for r in ratios]}


def paired_units(keys: list[str], rounds: int) -> int:
    """Progress units ``measure_paired`` reports at most (warm-up, rounds, and one repeat of them)."""
    return len(keys) * 2 * (1 + 2 * max(rounds, MIN_ROUNDS))


def measure_paired(baseline: tuple[nn.Module, CacheFactory], candidate: tuple[nn.Module, CacheFactory],
                   prompts: torch.Tensor, output_len: int, keys: list[str], rounds: int,
                   advance: Advance | None = None) -> dict[str, dict[str, Any]]:
    """``{paired_key(key): {...}}`` for each of ``keys`` (``throughput_tok_s``, ``ttft_ms``)."""
    advance = advance or (lambda _: None)
    rounds = max(rounds, MIN_ROUNDS)
    sides = [baseline, candidate]
    out = {}
    for key in keys:
        measure = MEASURES[key]
        for model, factory in sides:  # a warm-up each: one-time work lands in no round
            measure(model, prompts, output_len, factory)
            advance(f"{key} side by side warm-up")
        pairs = _rounds(sides, measure, prompts, output_len, rounds, 0, advance, f"{key} side by side")
        result = _summary(pairs)
        if result["noisy"]:  # once more: a burst of another process may have hit a few rounds
            pairs += _rounds(sides, measure, prompts, output_len, rounds, rounds, advance, f"{key} side by side")
            result = {**_summary(pairs), "repeated": True}
        out[paired_key(key)] = result
    return out
