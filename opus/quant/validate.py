"""The plan checked end to end: whole models timed on the run's workload, not just their kernels.

The planner adds up kernel timings measured one GEMM at a time. Whatever those miss (the ops around
the GEMMs, caches shared by the layers, the engine's own work) shows only when the whole model runs.
So the plan stage builds the planned model and every uniform assignment that fits the same predicted
budget (every free group, a tied lm_head included, in that format), runs each through the engine on
the workload's shape (interleaved, so that a slow moment of the machine hits every contender), and
keeps the per-layer plan unless a uniform one is measured clearly faster.

The contenders run unfused (the fuse stage comes later and changes every contender alike, except
that float experts group and quantized ones loop per expert): the check ranks assignments, it does
not predict the final figures. Memory: the float model once more, plus one quantized copy per
contender, all alive while they are timed (``end_to_end_check: false`` in the plan stage skips it).
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from opus.engine import generate
from opus.kvcache import cache_factory
from opus.quant.apply import quantize_model
from opus.quant.calibrate import ActivationStats
from opus.quant.planner import Candidate, GroupChoice

Progress = Callable[[float, float, str], None]
PLAN = "plan"
# A uniform assignment replaces the per-layer plan only when measured this much faster: closer than
# that, the two are within this machine's run-to-run noise and the plan's reasons stand.
MARGIN = 0.02


def uniform_alternatives(choices: list[GroupChoice], formats: list[str],
                         limit: float) -> tuple[dict[str, dict[str, Candidate]], list[str]]:
    """Every candidate format applied to all free groups (float where its kernel cannot take a layer),
    kept if its predicted cost fits ``limit``; and a note for each one that does not."""
    alternatives: dict[str, dict[str, Candidate]] = {}
    notes = []
    for fmt in formats:
        chosen = {}
        for group in choices:
            by_fmt = {c.fmt: c for c in group.candidates}
            chosen[group.name] = by_fmt[group.forced or (fmt if fmt in by_fmt else "fp32")]
        cost = sum(c.cost for c in chosen.values())
        if cost <= limit:
            alternatives[f"uniform {fmt}"] = chosen
        else:
            notes.append(f"uniform {fmt} not measured: predicted over the budget ({cost:.4g} > {limit:.4g})")
    return alternatives, notes


def workload_prompts(blocks: torch.Tensor, batch_size: int, input_len: int) -> torch.Tensor:
    """[batch, input_len] token ids cut from the calibration text (repeated when it is short)."""
    flat = blocks.reshape(-1)
    need = batch_size * input_len
    flat = flat.repeat(-(-need // flat.numel()))[:need]
    return flat.reshape(batch_size, input_len)


def _assignment(chosen: dict[str, Candidate], choices: list[GroupChoice]) -> dict[str, str]:
    return {m: chosen[g.name].fmt for g in choices for m in g.modules if chosen[g.name].fmt != "fp32"}


def measure_contenders(float_model: nn.Module, contenders: dict[str, dict[str, Candidate]],
                       choices: list[GroupChoice], stats: ActivationStats, group_size: int, workload: Any,
                       blocks: torch.Tensor, *, decode_steps: int = 16, repeats: int = 3,
                       progress: Progress | None = None) -> dict[str, dict[str, float]]:
    """Per contender: prefill ms, decode ms per step and the workload's batch ms (prefill plus
    ``output_len - 1`` decode steps), medians over ``repeats`` interleaved rounds."""
    models = {}
    for index, (name, chosen) in enumerate(contenders.items()):
        model = copy.deepcopy(float_model)
        quantize_model(model, _assignment(chosen, choices), stats, group_size=group_size)
        models[name] = model
        if progress:
            progress(index + 1, len(contenders), f"end-to-end check: built {name}")
    prompts = workload_prompts(blocks, workload.batch_size, workload.input_len)
    steps = max(1, min(decode_steps, workload.output_len - 1))
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    rounds = repeats + 1  # the first round warms up and is not counted
    for round_index in range(rounds):
        for index, (name, model) in enumerate(models.items()):
            result = generate(model, prompts, steps + 1, cache_factory(model))
            if round_index:
                samples[name].append((result.ttft_s * 1e3, result.decode_s * 1e3 / steps))
            if progress:
                progress(round_index * len(models) + index + 1, rounds * len(models), f"end-to-end check {name}")
    measured = {}
    for name, pairs in samples.items():
        prefill = statistics.median(p for p, _ in pairs)
        decode = statistics.median(d for _, d in pairs)
        measured[name] = {"prefill_ms": round(prefill, 3), "decode_step_ms": round(decode, 4),
                          "batch_ms": round(prefill + (workload.output_len - 1) * decode, 2)}
    return measured


def check_end_to_end(float_model: nn.Module, choices: list[GroupChoice], planned: dict[str, Candidate],
                     formats: list[str], limit: float, stats: ActivationStats, group_size: int, workload: Any,
                     blocks: torch.Tensor, progress: Progress | None = None
                     ) -> tuple[dict[str, Candidate], dict[str, Any], list[str]]:
    """``(chosen, report, notes)``: the per-layer plan, or a uniform assignment measured faster."""
    alternatives, notes = uniform_alternatives(choices, formats, limit)
    contenders = {PLAN: planned}
    for name, chosen in alternatives.items():
        if chosen == planned:
            notes.append(f"{name} is the per-layer plan itself")
        else:
            contenders[name] = chosen
    if len(contenders) == 1:
        notes.append("end-to-end check skipped: no uniform format differs from the plan within the budget")
        return planned, {}, notes
    measured = measure_contenders(float_model, contenders, choices, stats, group_size, workload, blocks,
                                  progress=progress)
    fastest = min(measured, key=lambda name: measured[name]["batch_ms"])
    clearly = measured[fastest]["batch_ms"] < (1 - MARGIN) * measured[PLAN]["batch_ms"]
    kept = fastest if clearly else PLAN
    report = {"workload": {"batch_size": workload.batch_size, "input_len": workload.input_len,
                           "output_len": workload.output_len},
              "contenders": measured, "kept": kept, "margin": MARGIN}
    if kept != PLAN:
        notes.append(f"{kept} measured faster end to end than the per-layer plan "
                     f"({measured[kept]['batch_ms']} vs {measured[PLAN]['batch_ms']} ms per batch): kept it")
    return contenders[kept], report, notes
