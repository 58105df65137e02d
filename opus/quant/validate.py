"""The plan checked end to end: whole models timed on the run's workload, not just their kernels.

The planner adds up kernel timings measured one GEMM at a time. Whatever those miss (the ops around
the GEMMs, caches shared by the layers, the engine's own work) shows only when the whole model runs.
So the plan stage builds the planned model and every uniform assignment that fits the same predicted
budget (every free group, a tied lm_head included, in that format) and whose linear layers, as
their kernels were timed, take no more than ``FAR_SLOWER`` times the plan's, runs each through the engine on
the workload's shape in interleaved rounds and picks by the shared rule of ``opus.runtime.timed_choice``: the
fastest, unless others are within the noise margin of it; then the more accurate (lower predicted
Δ cross-entropy), then the simpler (a uniform assignment before the per-layer plan).

Each contender runs as the later stages can run it (``runtime``). ``compiled``, where the static KV cache
can run the model (an Opus decoder): fused as the fuse stage fuses (opus.fusion, every pattern), a MoE's
experts in the ``compiled`` mode at prefill where they have one, decode steps compiled in the static
cache. ``eager``: unfused, the growing cache. The runtime changes the ranking: on K3 (Intel Xeon, AMX)
the eager check kept float experts (2,546 against 2,657 ms a batch for uniform W8A8), while fused and
compiled, uniform W8A8 ran the workload ×2.4 faster than fp32 eager and the plan's float experts ×1.8.
The check ranks assignments; it does not predict the final figures (the kv_config stage still chooses
the cache, and compiles the prefill where that wins). Memory: the float model once more, plus one
quantized copy per contender, all alive while they are timed (``end_to_end_check: false`` in the plan
stage skips it).
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from opus.kv.cache import cache_factory
from opus.quant.apply import quantize_model
from opus.quant.calibrate import ActivationStats
from opus.quant.formats import is_noop, noop_name
from opus.quant.knapsack import Candidate, GroupChoice
from opus.runtime.engine import timed_generate
from opus.runtime.timed_choice import DEFAULT_ROUNDS, Decision, Option, decide, reported

Progress = Callable[[float, float, str], None]
PLAN = "plan"
# The rest of the model is the same in every contender, so linear layers this much slower than the
# plan's cannot come out ahead: not worth timing (on a CPU without VNNI, uniform W8A8 prefilled 17×
# slower than the plan and took half of a 135M model's plan stage to time).
FAR_SLOWER = 2.0
RUNTIMES = ("auto", "compiled", "eager")
COMPILED = "compiled: fused, static KV cache"  # the report's word for the compiled runtime
# A contender's model made ready to time: (the model to run, its cache factory). None: as it is, growing cache.
Prepare = Callable[[nn.Module, torch.Tensor], tuple[nn.Module, Any]]


def check_runtime(model: nn.Module, runtime: str) -> tuple[str, str]:
    """(the runtime the check uses, why): ``auto`` is ``compiled`` where the static cache can run the model."""
    from opus.kv.static import decoder_reason

    if runtime not in RUNTIMES:
        raise ValueError(f"end-to-end check runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    reason = decoder_reason(model)
    if runtime == "compiled" and reason:
        raise ValueError(f"the end-to-end check cannot run compiled: {reason}")
    if runtime == "auto":
        return ("eager", f"eager: {reason}") if reason else ("compiled", COMPILED)
    return runtime, COMPILED if runtime == "compiled" else runtime


def kernel_ms(chosen: dict[str, Candidate]) -> float:
    """An assignment's linear layers over the workload, as their kernels were timed (medians)."""
    return sum(c.measured for c in chosen.values())


def uniform_alternatives(choices: list[GroupChoice], formats: list[str], limit: float,
                         planned: dict[str, Candidate] | None = None
                         ) -> tuple[dict[str, dict[str, Candidate]], list[str]]:
    """Every candidate format applied to all free groups (float where its kernel cannot take a layer),
    kept if its predicted cost fits ``limit`` and, given the ``planned`` assignment, its kernels alone
    are not ``FAR_SLOWER`` times the plan's; and a note for each one left out."""
    alternatives: dict[str, dict[str, Candidate]] = {}
    notes = []
    for fmt in formats:
        chosen = {}
        for group in choices:
            by_fmt = {c.fmt: c for c in group.candidates}
            chosen[group.name] = by_fmt[group.forced or (fmt if fmt in by_fmt else noop_name())]
        cost = sum(c.cost for c in chosen.values())
        if cost > limit:
            notes.append(f"uniform {fmt} not measured: predicted over the budget ({cost:.4g} > {limit:.4g})")
        elif planned is not None and kernel_ms(chosen) > FAR_SLOWER * kernel_ms(planned):
            notes.append(f"uniform {fmt} not measured: its kernels alone take {kernel_ms(chosen):.4g} ms, "
                         f"{kernel_ms(chosen) / kernel_ms(planned):.1f}× the plan's {kernel_ms(planned):.4g} ms")
        else:
            alternatives[f"uniform {fmt}"] = chosen
    return alternatives, notes


def workload_prompts(blocks: torch.Tensor, batch_size: int, input_len: int) -> torch.Tensor:
    """[batch, input_len] token ids cut from the calibration text (repeated when it is short)."""
    flat = blocks.reshape(-1)
    need = batch_size * input_len
    flat = flat.repeat(-(-need // flat.numel()))[:need]
    return flat.reshape(batch_size, input_len)


def _assignment(chosen: dict[str, Candidate], choices: list[GroupChoice]) -> dict[str, str]:
    return {m: chosen[g.name].fmt for g in choices for m in g.modules
            if not is_noop(chosen[g.name].fmt)}


def _error(chosen: dict[str, Candidate]) -> float:
    """Predicted Δ cross-entropy of an assignment (gains predicted below zero count as none)."""
    return sum(max(c.dce or 0.0, 0.0) for c in chosen.values())


def measure_contenders(float_model: nn.Module, contenders: dict[str, dict[str, Candidate]],
                       choices: list[GroupChoice], stats: ActivationStats, group_size: int, workload: Any,
                       blocks: torch.Tensor, *, decode_steps: int = 16, rounds: int = DEFAULT_ROUNDS,
                       progress: Progress | None = None, prepare: Prepare | None = None
                       ) -> tuple[dict[str, dict[str, float]], Decision]:
    """Per contender: prefill ms, decode ms per step (each round's median step) and the workload's
    batch ms (prefill plus ``output_len - 1`` decode steps), medians over ``rounds`` interleaved
    rounds (the first, uncounted, compiles); and the decision. ``prepare(model, probe prompt)`` makes each
    quantized contender ready to run (fused and compiled, say); None: as it is, in the growing cache."""
    prompts = workload_prompts(blocks, workload.batch_size, workload.input_len)
    steps = max(1, min(decode_steps, workload.output_len - 1))
    seen: dict[str, list[tuple[float, float]]] = {}

    def option(index: int, name: str, chosen: dict[str, Candidate]) -> Option:
        model = copy.deepcopy(float_model)
        quantize_model(model, _assignment(chosen, choices), stats, group_size=group_size)
        model, factory = prepare(model, prompts[:1]) if prepare else (model, cache_factory(model))
        if progress:
            progress(index + 1, len(contenders), f"end-to-end check: built {name}")

        def run() -> float:  # batch ms of the workload: the prefill, and the median step for every step
            _, prefill, step = timed_generate(model, prompts, steps + 1, factory)
            seen.setdefault(name, []).append((prefill * 1e3, step * 1e3))
            return (prefill + (workload.output_len - 1) * step) * 1e3

        return Option(name, run, error=_error(chosen), simplicity=int(name == PLAN))

    options = [option(i, name, chosen) for i, (name, chosen) in enumerate(contenders.items())]
    decision = decide("end-to-end check", options, rounds, timer=reported, unit="ms", progress=progress)
    measured = {}
    for name, pairs in seen.items():
        timed = pairs[-rounds:]  # the warm-up round is not counted
        measured[name] = {"prefill_ms": round(statistics.median(p for p, _ in timed), 3),
                          "decode_step_ms": round(statistics.median(d for _, d in timed), 4),
                          "batch_ms": round(decision.medians[name], 2)}
    return measured, decision


def check_end_to_end(float_model: nn.Module, choices: list[GroupChoice], planned: dict[str, Candidate],
                     formats: list[str], limit: float, stats: ActivationStats, group_size: int, workload: Any,
                     blocks: torch.Tensor, progress: Progress | None = None, rounds: int = DEFAULT_ROUNDS,
                     prepare: Prepare | None = None, runtime: str = "eager"
                     ) -> tuple[dict[str, Candidate], dict[str, Any], list[str], Decision | None]:
    """``(chosen, report, notes, decision)``: the per-layer plan, or the uniform assignment the
    shared rule picks over it (``decision`` is None when nothing but the plan was left to time).
    ``prepare`` readies each contender to run (``measure_contenders``); ``runtime`` says how, for the report."""
    alternatives, notes = uniform_alternatives(choices, formats, limit, planned)
    contenders = {PLAN: planned}
    for name, chosen in alternatives.items():
        if chosen == planned:
            notes.append(f"{name} is the per-layer plan itself")
        else:
            contenders[name] = chosen
    if len(contenders) == 1:
        notes.append("end-to-end check skipped: no uniform format differs from the plan within the budget")
        return planned, {}, notes, None
    measured, decision = measure_contenders(float_model, contenders, choices, stats, group_size, workload, blocks,
                                            rounds=rounds, progress=progress, prepare=prepare)
    kept = decision.winner
    report = {"workload": {"batch_size": workload.batch_size, "input_len": workload.input_len,
                           "output_len": workload.output_len}, "runtime": runtime,
              "contenders": measured, "kept": kept, "margin": round(decision.margin, 4), "tied": decision.tied,
              "reason": decision.reason}
    if kept != PLAN:
        notes.append(f"{kept} kept over the per-layer plan by the end-to-end check ({measured[kept]['batch_ms']} "
                     f"vs {measured[PLAN]['batch_ms']} ms per batch): {decision.reason}")
    return contenders[kept], report, notes, decision
