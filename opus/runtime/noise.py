"""How much a speed metric moves between repeats, and when a difference between two runs is noise.

Every timed metric is the median of its repeats and is stored with its spread under
``<key>_spread``: ``{"min", "median", "max", "n"}``. A dict under its own key, so that the metric
itself stays a plain number for every consumer (gates, summary, headline, report) and the spread is
one more entry that number-only readers skip; ``opus compare`` flattens it to
``<key>_spread.min`` etc.

Within noise: two measurements of a metric are within noise when their ``[min, max]`` ranges over
the repeats overlap. Rank-based, so it assumes no distribution: if both sides drew their ``n``
repeats from the same distribution, the ranges fail to overlap only when every repeat of one side
beats every repeat of the other, which happens with probability ``2 / C(2n, n)`` — 10% at the
default 3 repeats, 0.004% at D's 9 samples. A "better" or "worse" is therefore a claim that the
repeats do not contradict. One repeat (``n = 1``) gives a single point and no evidence of noise, so
such a difference is never marked within noise; more repeats make the mark meaningful.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

SPREAD_SUFFIX = "_spread"
# The speed metrics that are medians of repeats and carry a spread.
SPREAD_KEYS = ("throughput_tok_s", "decode_tok_s_batch", "prefill_ms_batch", "ttft_ms", "decode_tok_s")

Range = tuple[float, float]


def spread_key(key: str) -> str:
    return key + SPREAD_SUFFIX


PAIRED_SUFFIX = "_paired"  # a ratio measured side by side with the baseline (opus.runtime.paired)


def paired_key(key: str) -> str:
    return key + PAIRED_SUFFIX


def conservative_ratio(paired: dict[str, Any], bound: str) -> float:
    """The end of a paired ratio's interval a gate must use: the one least favourable to ``bound``."""
    return paired["low"] if bound in ("min_ratio", "max_decrease") else paired["high"]


def spread(values: Iterable[float]) -> dict[str, float | int]:
    """min, median, max and count of a metric's repeats."""
    data = sorted(float(v) for v in values)
    return {"min": data[0], "median": statistics.median(data), "max": data[-1], "n": len(data)}


def as_range(value: Any) -> Range | None:
    """``(min, max)`` of a stored spread, None when there is none or it is malformed."""
    if not isinstance(value, dict):
        return None
    low, high = value.get("min"), value.get("max")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (low, high)):
        return None  # e.g. NaN decode speed of one-token requests: no range to compare
    return float(low), float(high)


def overlap(a: Range | None, b: Range | None) -> bool | None:
    """Whether two ranges overlap; None when either is unknown (no judgement possible)."""
    if a is None or b is None:
        return None
    return a[0] <= b[1] and b[0] <= a[1]


def _record(summary: dict[str, Any], part: str) -> dict[str, Any]:
    """The stage metrics behind summary ``part``: the baseline's, or the final stage's."""
    for record in summary.get("stages") or []:
        if (part == "baseline" and record.get("baseline")) or (part == "final" and
                                                                 record.get("id") == summary.get("final_stage")):
            return record.get("metrics") or {}
    # No stage measured after the baseline: the summary's final measures are the baseline's.
    return _record(summary, "baseline") if part == "final" and summary.get("final_stage") is None else {}


def part_spreads(summary: dict[str, Any], part: str) -> dict[str, Any]:
    """``<key>_spread`` of the summary's ``baseline`` or ``final`` measures.

    Taken from the summary part itself when it carries them, else from the stage record the part was
    picked from (summary.json keeps every stage's full metrics).
    """
    own = summary.get(part) or {}
    source = _record(summary, part)
    out = {}
    for key in own:
        name = spread_key(key)
        found = own.get(name) if isinstance(own.get(name), dict) else source.get(name)
        if isinstance(found, dict):
            out[name] = found
    return out


def how_measured(interval: dict) -> str:
    """How a ratio's interval was measured, for a person: paired rounds, or bracketed with its drift."""
    if interval.get("method") == "bracketed":
        return f"bracketed, baseline drift {interval.get('drift', 0.0):+.1%}"
    return f"side by side, {interval['n']} rounds" if "n" in interval else "side by side"
