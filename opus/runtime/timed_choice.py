"""Choices made from timings, made so that they repeat.

Every option the pipeline picks by speed (the plan stage's kernel timings and end-to-end check, the
kv_config stage's cache, the fuse stage's compile choice) is decided here, by one rule:

1. Interleaved rounds: a warm-up round, then ``rounds`` rounds of A, B, C, A, B, C, ... A slow moment
   of the machine then hits every option alike, not whichever happened to run then.
2. The median of each option's rounds: one outlier round moves no median.
3. A noise margin measured on the spot: the median over the options of their relative interquartile
   range (IQR / median of an option's rounds), and at least ``MIN_MARGIN``. The median over options
   so that one option caught in a burst of another process does not tie everything; the full IQR
   (not half) because two medians of a few rounds each differ by about that much when the options
   are equally fast; the floor for the drift between runs that a few rounds inside one run cannot show.
4. The pick: the fastest median, but every option within the margin of it (median <= fastest x
   (1 + margin)) is tied with it; among the tied the more accurate (lower error), then the simpler
   (lower simplicity rank), then the faster wins.
5. Noise that decides: when the margin is wider than ``WIDE_MARGIN`` and the tie handed the pick to
   an option other than the fastest, the same number of rounds is run once more and the rule applied
   to all of them (a burst of another process passes; the reason says so). Never more than once.

``faster_every_round`` is a paired check on top that a caller may add (kv_config's time to first token):
an option tied with the winner that was faster in every one of at least five rounds, by a median ratio of
at least ``MIN_MARGIN``, is faster beyond the noise even when drift widened the margin.

A ``Decision`` keeps the rounds, medians, margin, tied set, winner and reason; stages write their
decisions to ``decisions.json`` (``write_decisions``) and the report shows them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Timer = Callable[[Callable[[], Any]], float]
Progress = Callable[[float, float, str], None]
DECISIONS_FILE = "decisions.json"
DEFAULT_ROUNDS = 5  # with 5 rounds the IQR ignores one outlier round on either side
MIN_MARGIN = 0.02
WIDE_MARGIN = 0.10  # above this, a pick made by the tie-break alone is measured once more (rule 5)
PAIRED_ROUNDS = 5  # faster_every_round: rounds a paired comparison needs
# An option that lost a tie is counted this much slower than the winner, so that a solver adding up
# times (the planner's knapsack) prefers the winner wherever both fit.
NUDGE = 1e-6
RULE = ("interleaved rounds; median per option; noise margin = max(median over the options of "
        f"IQR/median, {MIN_MARGIN}); options within the margin of the fastest are tied; among the tied "
        "the more accurate, then the simpler wins; a pick the tie-break made under a margin over "
        f"{WIDE_MARGIN:.0%} is measured once more")


def _sync() -> None:
    import torch  # here, not at the top: the report reads decisions without torch

    if torch.cuda.is_initialized():  # a cheap flag; CUDA that nothing started has nothing queued
        torch.cuda.synchronize()


def now() -> float:
    """``time.perf_counter()`` once queued CUDA work is done: a time stamp that work has reached."""
    _sync()
    return time.perf_counter()


def wall_clock(call: Callable[[], Any]) -> float:
    """Seconds one call takes; queued CUDA work is waited for on both sides."""
    start = now()
    call()
    return now() - start


def reported(call: Callable[[], Any]) -> float:
    """For options that time themselves (the engine's own timings): the number the call returns."""
    return float(call())


@dataclass(frozen=True)
class Option:
    name: str
    run: Callable[[], Any] | None = None  # None: timed elsewhere (``decide_from``)
    error: float = 0.0  # lower is more accurate, e.g. predicted Δ cross-entropy; equal when unknown
    simplicity: int = 0  # lower is simpler: float before quantized, eager before compiled


@dataclass
class Decision:
    what: str
    unit: str
    samples: dict[str, list[float]]
    medians: dict[str, float]
    margin: float
    tied: list[str]
    winner: str
    reason: str
    options: dict[str, Option] = field(default_factory=dict, repr=False)
    replayed_from: str | None = None

    def record(self) -> dict[str, Any]:
        """The decision as JSON for ``decisions.json`` and the report."""
        rows = [{"name": name, "median": _round(self.medians.get(name)),
                 "rounds": [_round(s) for s in self.samples.get(name, [])],
                 "error": _round(opt.error), "simplicity": opt.simplicity} for name, opt in self.options.items()]
        out = {"what": self.what, "unit": self.unit, "candidates": rows, "margin": round(self.margin, 4),
               "tied": self.tied, "winner": self.winner, "reason": self.reason}
        return {**out, "replayed_from": self.replayed_from} if self.replayed_from else out


def _round(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.5g}")


def interleave(options: list[Option], rounds: int = DEFAULT_ROUNDS, *, warmup: int = 1, timer: Timer = wall_clock,
               progress: Progress | None = None, what: str = "") -> dict[str, list[float]]:
    """Each option's timings over ``rounds`` interleaved rounds, after ``warmup`` uncounted ones."""
    samples: dict[str, list[float]] = {o.name: [] for o in options}
    total = (warmup + rounds) * len(options)
    for index in range(warmup + rounds):
        for position, option in enumerate(options):
            if option.run is None:
                raise ValueError(f"option '{option.name}' has nothing to time")
            taken = timer(option.run)
            if index >= warmup:
                samples[option.name].append(taken)
            if progress:
                progress(index * len(options) + position + 1, total, f"{what}: {option.name}".strip(": "))
    return samples


def relative_spread(values: list[float]) -> float:
    """IQR over median (0 for fewer than two values, or a zero median)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    middle = statistics.median(values)
    return (q3 - q1) / middle if middle > 0 else 0.0


def noise_margin(samples: dict[str, list[float]], floor: float = MIN_MARGIN) -> float:
    spreads = [relative_spread(v) for v in samples.values()]
    return max(floor, statistics.median(spreads)) if spreads else floor


def _preference(options: dict[str, Option], medians: dict[str, float]) -> Callable[[str], tuple]:
    def key(name: str) -> tuple:
        option = options.get(name, Option(name))
        return option.error, option.simplicity, medians[name], name
    return key


def _first_tier(medians: dict[str, float], margin: float, options: dict[str, Option]) -> tuple[str, list[str], str]:
    """(fastest, tied with it, winner of the tie)."""
    fastest = min(medians, key=lambda n: (medians[n], n))
    tied = sorted((n for n in medians if medians[n] <= medians[fastest] * (1 + margin)), key=medians.get)
    return fastest, tied, min(tied, key=_preference(options, medians))


def _reason(fastest: str, tied: list[str], winner: str, margin: float, options: dict[str, Option]) -> str:
    if len(tied) == 1:
        others = len(options) > 1
        return f"fastest by more than the {margin:.1%} noise margin" if others else "the only candidate"
    rest = ", ".join(n for n in tied if n != winner)
    if winner == fastest:
        return f"fastest; tied within the {margin:.1%} noise margin with {rest}, none more accurate or simpler"
    why = ("more accurate" if options[winner].error < options[fastest].error else "as accurate and simpler")
    return f"within the {margin:.1%} noise margin of the fastest ({fastest}) and {why}"


def decide_from(what: str, options: Iterable[Option], samples: dict[str, list[float]], *, unit: str = "s",
                min_margin: float = MIN_MARGIN) -> Decision:
    """The decision over timings already taken (one list per option, round by round)."""
    by_name = {o.name: o for o in options}
    medians = {name: statistics.median(samples[name]) for name in by_name}
    margin = noise_margin({n: samples[n] for n in by_name}, min_margin)
    fastest, tied, winner = _first_tier(medians, margin, by_name)
    return Decision(what, unit, {n: list(samples[n]) for n in by_name}, medians, margin, tied, winner,
                    _reason(fastest, tied, winner, margin, by_name), by_name)


def faster_every_round(decision: Decision) -> tuple[str, float] | None:
    """Of the options tied with the winner, one that was faster than the winner in every round, by a median
    ratio of at least ``MIN_MARGIN``, and is no less accurate: (its name, that median ratio), the lowest such
    ratio where several were; None where none was, or under ``PAIRED_ROUNDS`` rounds.

    Round i of every option ran back to back (rule 1), so a machine that slowed down part-way widens each
    option's IQR, and with it the margin, yet moves both sides of a round's ratio alike. An option as fast as
    the winner beats it in all of ``PAIRED_ROUNDS`` rounds one time in 2^5."""
    base = decision.samples.get(decision.winner, [])
    if len(base) < PAIRED_ROUNDS or min(base) <= 0:
        return None
    error = decision.options[decision.winner].error if decision.winner in decision.options else 0.0
    found: list[tuple[float, str]] = []
    for name in decision.tied:
        taken = decision.samples.get(name, [])
        if name == decision.winner or len(taken) != len(base):
            continue
        if name in decision.options and decision.options[name].error > error:
            continue
        ratios = [t / b for t, b in zip(taken, base)]
        if max(ratios) < 1 and (ratio := statistics.median(ratios)) <= 1 - MIN_MARGIN:
            found.append((ratio, name))
    if not found:
        return None
    ratio, name = min(found)
    return name, ratio


def decide(what: str, options: list[Option], rounds: int = DEFAULT_ROUNDS, *, warmup: int = 1,
           timer: Timer = wall_clock, unit: str = "s", min_margin: float = MIN_MARGIN,
           progress: Progress | None = None, on_repeat: Callable[[], None] | None = None) -> Decision:
    """Time the options in interleaved rounds and pick by the rule in this module's docstring;
    ``on_repeat`` is called before rule 5 runs the rounds again (a caller's progress expects more)."""
    samples = interleave(options, rounds, warmup=warmup, timer=timer, progress=progress, what=what)
    decision = decide_from(what, options, samples, unit=unit, min_margin=min_margin)
    fastest = min(decision.medians, key=lambda n: (decision.medians[n], n))
    if decision.margin <= WIDE_MARGIN or decision.winner == fastest:
        return decision
    if on_repeat:
        on_repeat()
    more = interleave(options, rounds, warmup=0, timer=timer, progress=progress, what=f"{what} (again)")
    first = decision.margin
    decision = decide_from(what, options, {n: samples[n] + more[n] for n in samples}, unit=unit,
                           min_margin=min_margin)
    decision.reason += (f" (over {2 * rounds} rounds: the first {rounds} had a {first:.1%} margin, and the "
                        f"tie-break alone set the pick)")
    return decision


def credible(decision: Decision) -> dict[str, float]:
    """Each option's time as a solver that adds times up should count it (the planner's knapsack).

    The rule applied tier by tier: the fastest remaining option and those tied with it form a tier;
    its winner keeps its median, the others count as a hair slower than the winner. An option that
    loses a tie thus wins only where the winner is not allowed (over a budget).
    """
    left, out = dict(decision.medians), {}
    while left:
        _, tied, winner = _first_tier(left, decision.margin, decision.options)
        floor = left[winner] * (1 + NUDGE)
        for name in tied:
            out[name] = left[name] if name == winner else max(left[name], floor)
            del left[name]
    return out


def run_relative(path: str) -> str:
    """An artifact path from its run directory on (``RUN/stages/03-x/artifacts/f``, ``RUN/artifacts/x/f``):
    how a published decision names its source without an absolute path."""
    parts = Path(path).parts
    if not Path(path).is_absolute():
        return path
    for marker in ("stages", "artifacts"):
        if marker in parts[1:]:
            i = parts.index(marker)
            return str(Path(*parts[i - 1:]))
    return Path(path).name


def replayed(what: str, winner: str, source: str, unit: str = "s") -> Decision:
    """A decision taken from another run (``run.decisions_from``): nothing timed here."""
    source = run_relative(source)
    return Decision(what, unit, {}, {}, 0.0, [winner], winner, f"replayed from {source}",
                    {winner: Option(winner)}, replayed_from=source)


def write_decisions(ctx: Any, decisions: list[Decision]) -> None:
    """``decisions.json`` in the stage's artifacts (``ctx`` is the StageContext)."""
    ctx.write_artifact(DECISIONS_FILE, {"version": 1, "rule": RULE, "decisions": [d.record() for d in decisions]})
