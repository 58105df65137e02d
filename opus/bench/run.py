"""``opus bench``: every contender, one after another in this process, on the same inputs.

The fp32 baseline runs first (its greedy continuations are the agreement reference, its figures
the denominators of every ratio); a contender that cannot run here gets a row with the reason.
"""

from __future__ import annotations

import ctypes
import gc
import platform
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opus.bench import hf_contender, llamacpp, onnx_contenders, torch_contenders
from opus.bench.core import BenchContext, Contender, Row, Unavailable, judge, measure, units
from opus.bench.gguf import cache_root
from opus.bench.target import Target, pipeline_budget, resolve_target
from opus.errors import InputError, OpusError
from opus.export.native import one_line
from opus.pipeline.spec import WorkloadSpec
from opus.runtime.machine import describe, recorded
from opus.runtime.metrics import Progress, Settings, fidelity_prompts, prepare_inputs


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
            *llamacpp.contenders(user_gguf), torch_contenders.OPUS_RUN]


def select(contenders: list[Contender], only: list[str] | None) -> list[Contender]:
    """The baseline always (every ratio needs it), plus what ``only`` names: a contender, its prefix
    (``llama`` → llama-f16, llama-q8_0) or its family (torch, transformers, onnxruntime, llama.cpp)."""
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
    threads = request.threads or spec.run.threads or torch.get_num_threads()
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
                       no_run_reason=target.no_run_reason, log=log)
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
        # completed by run_bench with the machine record (CPU, ISA, threads, libraries, load)
        "environment": f"device {spec.model.device}, {platform.machine()} {platform.system()}",
    }
    return ctx, report


def _return_freed_memory() -> None:
    """glibc keeps freed heap pages; give them back so the next contender starts from a lower RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the peak figures then include more of what earlier contenders left behind


def _measure_one(contender: Contender, ctx: BenchContext, display: Any, offset: float, baseline: bool) -> Row:
    row = Row(contender.name, contender.label, contender.family)
    progress = Progress(lambda done, total, what: display.update(offset + done, f"{contender.name}: {what}"))
    started = time.monotonic()
    display.update(offset, f"{contender.name}: preparing")
    try:
        built = contender.build(ctx)
        try:
            row.notes = built.notes  # the same list: close() may add what it saw during the run
            row.metrics = measure(built, ctx, progress, baseline)
        finally:
            if built.close is not None:
                built.close()
            del built
    except Unavailable as exc:
        row.status, row.reason = "skipped", str(exc)
    except Exception as exc:  # noqa: BLE001 - one contender's failure is a finding, not the end of the bench
        row.status, row.reason, row.detail = "failed", one_line(exc), traceback.format_exc()
    gc.collect()  # the next contender's memory figure must not include this one's model
    _return_freed_memory()
    row.seconds = time.monotonic() - started
    return row


def run_bench(request: BenchRequest, display: Any) -> tuple[dict[str, Any], list[Row]]:
    target = resolve_target(request.target, request.runs_dir)
    user_gguf = request.gguf is not None or target.loaded.spec.model.gguf is not None
    chosen = [*select(all_contenders(user_gguf), request.only), *request.extra]
    with tempfile.TemporaryDirectory(prefix="opus-bench-") as tmp, recorded(machine := {}):
        ctx, report = prepare(request, target, Path(tmp), display.line)
        per = units(ctx)
        w = ctx.workload
        display.start(per * len(chosen) + (max(1, w.warmup) + w.repeats) * w.output_len)  # + the drift re-check
        rows: list[Row] = []
        for index, contender in enumerate(chosen):
            row = _measure_one(contender, ctx, display, index * per, baseline=index == 0)
            if index == 0 and row.status != "ok":
                raise OpusError(f"the fp32 baseline could not be measured: {row.reason}")
            rows.append(row)
            display.finished(row)
        if len(chosen) > 1 and ctx.settings.throughput:
            display.update(per * len(chosen), "fp32: P again (drift)")
            report["baseline_recheck"] = _recheck(chosen[0], ctx, rows[0].metrics.get("throughput_tok_s"))
    report["machine"] = machine["machine"]  # the CPU, its ISA, threads, kernel library and load before/after
    report["environment"] += f"; {describe(machine['machine'])}"
    judge(rows, report["budget"]["value"])
    return report, rows


def _recheck(baseline: Contender, ctx: BenchContext, first: float | None) -> dict[str, Any]:
    """The baseline's P measured again after every contender: how much the machine drifted meanwhile
    (another process, thermal limits), i.e. how much noise the ratios carry."""
    from opus.runtime.metrics import measure_throughput

    built = baseline.build(ctx)
    try:
        again = measure_throughput(built.model, ctx.inputs.prompts, ctx.workload.output_len, built.factory,
                                   ctx.workload.warmup, ctx.workload.repeats)["throughput_tok_s"]
    finally:
        del built
        gc.collect()
    drift = again / first - 1 if first else None
    return {"throughput_tok_s": again, "first": first, "drift": drift}
