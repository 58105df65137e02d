"""``opus bench``: every contender in this process, on the same inputs, timed in interleaved rounds.

The fp32 baseline is built first (its greedy continuations are the agreement reference, its figures
the denominators of every ratio); a contender that cannot run here gets a row with the reason. The
contenders are built and kept, then timed together, round after round (``opus.bench.rounds``); when
they would not all fit in memory, in groups that do, each with the baseline.
"""

from __future__ import annotations

import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opus.bench import hf_contender, llamacpp, onnx_contenders, openvino_contender, torch_contenders
from opus.bench.bandwidth import bound_figures, copy_bandwidth_gb_s, read_fraction
from opus.bench.core import BenchContext, Contender, Row, judge, once_units, resident_mb, round_units, ttft_requests
from opus.bench.gguf import cache_root
from opus.bench.rounds import (
    Entry,
    MemoryPlan,
    available_mb,
    build_once,
    close,
    free_memory,
    measure_group,
    plan_groups,
    timed_rounds,
)
from opus.bench.target import Target, pipeline_budget, resolve_target
from opus.errors import InputError, OpusError
from opus.pipeline.spec import WorkloadSpec
from opus.runtime.machine import describe, recorded, thread_count
from opus.runtime.metrics import Progress, Settings, fidelity_prompts, model_mb, prepare_inputs


@dataclass
class BenchRequest:
    target: Path
    runs_dir: Path = Path("runs")
    only: list[str] | None = None
    batch_size: int | None = None
    input_len: int | None = None
    output_len: int | None = None
    warmup: int | None = None
    repeats: int | None = None
    eval_samples: int | None = None
    eval_len: int | None = None
    budget: float | None = None
    threads: int | None = None
    gguf: Path | None = None
    converter: Path | None = None
    group_size: int = 64
    # Contenders a caller adds (a bench/ script: what opus itself cannot build), measured after the chosen ones.
    extra: tuple[Contender, ...] = ()


def all_contenders(user_gguf: bool) -> list[Contender]:
    return [*torch_contenders.CONTENDERS, *hf_contender.CONTENDERS, *onnx_contenders.CONTENDERS,
            *openvino_contender.CONTENDERS,
            *llamacpp.contenders(user_gguf), torch_contenders.OPUS_RUN]


def select(contenders: list[Contender], only: list[str] | None) -> list[Contender]:
    """The baseline always (every ratio needs it), plus what ``only`` names: a contender, its prefix
    (``llama`` → llama-f16, llama-q8_0) or its family (torch, transformers, onnxruntime, openvino,
    llama.cpp)."""
    if not only:
        return contenders
    def chosen(c: Contender, token: str) -> bool:
        return token in (c.name, c.family, c.name.split("-")[0])

    unknown = [t for t in only if not any(chosen(c, t) for c in contenders)]
    if unknown:
        raise InputError(f"unknown contender '{unknown[0]}' (known: {', '.join(c.name for c in contenders)})",
                         key="--only")
    return [c for i, c in enumerate(contenders) if i == 0 or any(chosen(c, t) for t in only)]


def _workload(spec_workload: WorkloadSpec, r: BenchRequest) -> WorkloadSpec:
    given = {"batch_size": r.batch_size, "input_len": r.input_len, "output_len": r.output_len,
             "warmup": r.warmup, "repeats": r.repeats}
    return spec_workload.model_copy(update={k: v for k, v in given.items() if v is not None})


# The baseline stage's defaults (stages/baseline.py; opus never imports stages).
FIDELITY_DEFAULTS = {"fidelity_prompts": 4, "fidelity_prompt_len": 64, "fidelity_tokens": 16}


def _fidelity_settings(spec: Any) -> tuple[int, int, int]:
    """The baseline stage's fidelity prompts (count, length, tokens), so agreement means the same here."""
    stage = next((s for s in spec.stages if s.uses == "baseline"), None)
    given = {**FIDELITY_DEFAULTS, **{k: v for k, v in (stage.with_ if stage else {}).items() if k in FIDELITY_DEFAULTS}}
    return given["fidelity_prompts"], given["fidelity_prompt_len"], given["fidelity_tokens"]


def prepare(request: BenchRequest, target: Target, work_dir: Path,
            log: Any) -> tuple[BenchContext, dict[str, Any]]:
    from opus.models import load_model

    spec, base_dir = target.loaded.spec, target.loaded.base_dir
    threads = request.threads or thread_count(spec.run.threads) or torch.get_num_threads()
    torch.set_num_threads(threads)
    workload = _workload(spec.workload, request)
    evaluation = spec.data.evaluation
    if evaluation is not None:
        update = {"samples": request.eval_samples, "seq_len": request.eval_len}
        evaluation = evaluation.model_copy(update={k: v for k, v in update.items() if v is not None})
    model, tokenizer = load_model(spec.model.source(), base_dir, dtype="float32", device=spec.model.device)
    inputs = prepare_inputs(model, tokenizer, workload, evaluation, base_dir, log)
    count, length, tokens = _fidelity_settings(spec)
    prompts, prompt_source = fidelity_prompts(model, inputs, count, length)
    ctx = BenchContext(source=spec.model.source(), base_dir=base_dir, device=spec.model.device, tokenizer=tokenizer,
                       inputs=inputs, workload=workload, settings=Settings(), fidelity_prompts=prompts,
                       fidelity_tokens=tokens, threads=threads, vocab_size=int(model.config.vocab_size),
                       group_size=request.group_size, gguf=request.gguf, converter=request.converter,
                       cache_dir=cache_root(), work_dir=work_dir, checkpoint=target.checkpoint, spec=spec,
                       no_run_reason=target.no_run_reason, log=log, fp32_mb=model_mb(model),
                       bandwidth_gb_s=copy_bandwidth_gb_s(), read_fraction=read_fraction(model))
    del model
    budget, source = (request.budget, "--budget") if request.budget is not None else pipeline_budget(target.loaded)
    blocks = inputs.eval_blocks
    report = {
        "pipeline": str(target.loaded.path), "run": str(target.run_dir) if target.run_dir else None,
        "run_stage": target.stage, "no_run_reason": target.no_run_reason,
        "workload": workload.model_dump(), "prompt_source": inputs.prompt_source,
        "evaluation": "none declared: no perplexity" if blocks is None else
                      f"{blocks.shape[0]} blocks × {blocks.shape[1]} tokens of data.evaluation",
        "fidelity": f"{count} prompts × {prompts.shape[1]} tokens ({prompt_source}), {tokens} greedy tokens each",
        "budget": {"value": budget, "source": source},
        "bandwidth": {"copy_gb_s": round(ctx.bandwidth_gb_s, 2), "read_fraction": round(ctx.read_fraction, 4),
                      "threads": threads},
        # completed by run_bench with the machine record (CPU, ISA, threads, libraries, load)
        "environment": f"device {spec.model.device}, {platform.machine()} {platform.system()}",
    }
    return ctx, report


def run_bench(request: BenchRequest, display: Any) -> tuple[dict[str, Any], list[Row]]:
    target = resolve_target(request.target, request.runs_dir)
    user_gguf = request.gguf is not None or target.loaded.spec.model.gguf is not None
    chosen = [*select(all_contenders(user_gguf), request.only), *request.extra]
    with tempfile.TemporaryDirectory(prefix="opus-bench-") as tmp, recorded(machine := {}):
        ctx, report = prepare(request, target, Path(tmp), display.line)
        free_memory()
        floor = resident_mb(ctx.device)  # before any contender: what each one's memory figure excludes
        plan = plan_groups(chosen, ctx.fp32_mb, available_mb(ctx.device))
        if plan.grouped:
            display.line(f"memory: {_grouping(plan)}")
        rows = [Row(c.name, c.label, c.family) for c in chosen]
        display.start(_total_units(ctx, plan))
        progress = Progress(lambda done, total, what: display.update(done, what), interval_s=0.2)
        alive: list[Entry] = []  # closed at the end, also when the bench stops early (Ctrl-C, the baseline failing)
        try:
            groups = _measure_groups(chosen, rows, plan, ctx, progress, floor, display, alive)
        finally:
            for entry in alive:
                if entry.built is not None:
                    close(entry)
        report["timing"] = _timing(plan, groups)
        if len(groups) > 1:
            rows[0].notes.append(f"timed in the rounds of each of the {len(groups)} groups; its figures are "
                                 "group 1's, each ratio pairs a contender with the baseline in its own group")
    report["machine"] = machine["machine"]  # the CPU, its ISA, threads, kernel library and load before/after
    report["environment"] += f"; {describe(machine['machine'])}"
    judge(rows, report["budget"]["value"])
    for row in rows:
        if row.status == "ok":
            row.metrics.update(bound_figures(row.metrics, ctx.bandwidth_gb_s, ctx.read_fraction))
    report["timing"]["noisy"] = [f"{row.name} {key}" for row in rows for key, i in row.intervals.items()
                                 if i.get("noisy")]
    return report, rows


def _measure_groups(chosen: list[Contender], rows: list[Row], plan: MemoryPlan, ctx: BenchContext,
                    progress: Progress, floor: float, display: Any, alive: list[Entry]) -> list[dict[str, Any]]:
    """Build the baseline, then group by group: build the group's contenders, time the group with the
    baseline in interleaved rounds, close the group's contenders. What the report says of each group."""
    base = build_once(chosen[0], rows[0], ctx, progress, True, floor)
    if base.built is None:
        raise OpusError(f"the fp32 baseline could not be measured: {rows[0].reason}")
    alive.append(base)
    groups = []
    index = 1
    for number, group in enumerate(plan.groups):
        if plan.grouped:
            display.line(f"group {number + 1}/{len(plan.groups)}: fp32, {', '.join(c.name for c in group)}")
        entries = [base]
        for contender in group:
            entry = build_once(contender, rows[index], ctx, progress, False, floor)
            index += 1
            entries.append(entry)
            alive.append(entry)
            if entry.built is None:
                display.finished(entry.row)
        if number > 0 and all(entry.built is None for entry in entries[1:]):
            continue  # nothing of this group could be built: no rounds to pair with the baseline
        info = measure_group(entries, ctx, progress, getattr(display, "extend", None))
        if "failed" in info:
            raise OpusError(f"the fp32 baseline failed during the timed rounds: {info['failed']}")
        info["baseline"] = {k: v for k, v in base.timed.items() if k in ("throughput_tok_s", "ttft_ms")}
        groups.append(info)
        for entry in entries:
            if entry is base and number > 0:
                continue  # the baseline's figures are its first group's; later groups only pair with it
            entry.row.metrics.update(entry.timed)
        if number == 0:
            display.finished(base.row)
        for entry in entries[1:]:
            if entry.built is not None:  # built: its row is complete now (a failure in the rounds included)
                close(entry)
                display.finished(entry.row)
    return groups


def _total_units(ctx: BenchContext, plan: MemoryPlan) -> float:
    """Progress units of the whole bench, every contender buildable (a skipped one shortens it)."""
    total = once_units(ctx) * (1 + sum(len(g) for g in plan.groups))
    for group in plan.groups:
        sides = 1 + len(group)
        rounds = timed_rounds(ctx.workload.repeats, sides)
        total += (1 + rounds) * sides * round_units(ctx, ttft_requests(rounds))  # a warm-up round first
    return total


def _grouping(plan: MemoryPlan) -> str:
    return (f"the contenders would hold ~{plan.need_mb:.0f} MB at once (fp32 model {plan.fp32_mb:.0f} MB) and "
            f"{plan.available_mb:.0f} MB is available: planned in {len(plan.groups)} groups that fit, timed one "
            "after another, each with the fp32 baseline in its rounds")


def _timing(plan: MemoryPlan, groups: list[dict[str, Any]]) -> dict[str, Any]:
    """What the report says about how the timed figures were taken."""
    return {"interleaved": True,
            "method": "every contender built and kept, then one untimed warm-up round and the timed rounds; each "
                      "round runs every contender of its group once (its P request, then its D requests), round r "
                      "starting at contender r mod N; a timed figure is the median over the rounds, a ratio the "
                      "median of the per-round ratios to fp32 with [min, max] over the rounds, measured again "
                      "once when wider than 15 % and then marked noisy",
            "groups": groups, "grouping": _grouping(plan) if plan.grouped else None,
            "memory": {"available_mb": round(plan.available_mb), "fp32_mb": round(plan.fp32_mb, 1),
                       "estimated_need_mb": round(plan.need_mb)}}
