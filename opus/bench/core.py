"""What every contender of ``opus bench`` shares: the interface, the inputs, and its measurements.

A contender is a name and a ``build(ctx) -> Built`` function. ``Built.model`` follows the engine's
LM interface (``model(input_ids, cache=None, start_pos=0, last_only=False) -> logits``): an Opus
decoder, or an adapter that puts another runtime (onnxruntime, llama.cpp) behind that interface.
Every contender is then measured by the same code, in two parts:

- ``measure_once``, right after its build: warm-ups, peak memory of its first batch run, perplexity
  (``opus.runtime.metrics.evaluate_lm``) and agreement (``compare_to_reference``) — what does not
  depend on how busy the machine is;
- ``timed_run``, once per round of ``opus.bench.rounds``: one P request (the workload's batch) and
  the D request(s) at batch 1, interleaved with the other contenders' runs.

So the same workload, prompts and evaluation blocks reach every runtime. ``build`` raises
``Unavailable`` when the contender cannot run here (a missing package, kernel or device); the row
then carries that reason instead of figures.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from opus.kv.cache import CacheFactory
from opus.pipeline.spec import WorkloadSpec
from opus.runtime.engine import generate, model_device
from opus.runtime.metrics import (
    MB,
    TTFT_SAMPLES,
    Inputs,
    PeakMemory,
    Progress,
    Reference,
    Settings,
    compare_to_reference,
    evaluate_lm,
    fidelity_units,
    make_reference,
    memory_figures,
    model_mb,
)
from opus.runtime.noise import paired_key


class Unavailable(Exception):
    """The contender cannot run on this machine; the message says why."""


@dataclass
class Built:
    model: nn.Module  # follows the engine's LM interface
    factory: CacheFactory
    notes: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)  # e.g. compile_s; model_mb of a file
    close: Callable[[], None] | None = None


@dataclass
class BenchContext:
    """What the contenders are measured on, built once per ``opus bench``."""

    source: dict[str, Any]  # the pipeline's model source
    base_dir: Path
    device: str
    tokenizer: Any
    inputs: Inputs  # workload prompts and evaluation blocks
    workload: WorkloadSpec
    settings: Settings
    fidelity_prompts: torch.Tensor  # [n, L]: agreement is measured on these
    fidelity_tokens: int
    threads: int
    vocab_size: int
    fp32_mb: float = 0.0  # the fp32 model's parameters and buffers: what the memory plan scales
    bandwidth_gb_s: float = 0.0  # the machine's copy bandwidth, measured before any contender (opus.bench.bandwidth)
    read_fraction: float = 1.0  # the share of the model's bytes a decoded token reads
    group_size: int = 64
    gguf: Path | None = None  # the user's own GGUF file (--gguf)
    converter: Path | None = None  # llama.cpp's convert_hf_to_gguf.py (--converter)
    cache_dir: Path = Path(".")  # converted GGUFs, unpacked converter
    work_dir: Path = Path(".")  # temporary files of this run (ONNX graphs)
    checkpoint: Path | None = None  # the Opus run's final checkpoint (the "opus" contender)
    spec: Any = None  # opus.pipeline.spec.PipelineSpec
    no_run_reason: str = ""
    log: Callable[[str], None] = print
    reference: Reference | None = None  # set by the baseline
    shared: dict[str, Any] = field(default_factory=dict)  # artifacts several contenders reuse

    def load(self, dtype: str = "float32") -> nn.Module:
        from opus.models import load_model

        model, _ = load_model(self.source, self.base_dir, dtype=dtype, device=self.device)
        return model.eval()

    @property
    def eval_samples(self) -> int:
        return 0 if self.inputs.eval_blocks is None else int(self.inputs.eval_blocks.shape[0])


@dataclass(frozen=True)
class Contender:
    name: str  # what --only selects
    label: str  # one line: what runs
    family: str  # torch | transformers | onnxruntime | openvino | llama.cpp
    build: Callable[[BenchContext], Built]


@dataclass
class Row:
    name: str
    label: str
    family: str
    status: str = "ok"  # ok | skipped | failed
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    ratios: dict[str, float] = field(default_factory=dict)
    # key -> {low, high, n, noisy[, repeated]}: the interval of a ratio from paired rounds
    intervals: dict[str, dict[str, Any]] = field(default_factory=dict)
    ppl_increase: float | None = None
    verdict: str = "n/a"  # within | over | n/a
    seconds: float = 0.0
    detail: str = ""  # the traceback of a failure (JSON only)


def _batch1_tokens(ctx: BenchContext) -> int:
    """Tokens of a D request: the workload's output when decode speed at batch 1 is measured, else one."""
    return ctx.workload.output_len if ctx.settings.decode_batch1 else 1


def once_units(ctx: BenchContext) -> int:
    """Progress units (forward passes) of ``measure_once``."""
    w, s = ctx.workload, ctx.settings
    warmups = max(1, w.warmup)
    units = (warmups + 1) * w.output_len if s.throughput else 0
    units += warmups * _batch1_tokens(ctx) if s.ttft else 0
    units += math.ceil(ctx.eval_samples / s.eval_batch_size) if s.quality else 0
    return units + fidelity_units(ctx.fidelity_tokens)


def round_units(ctx: BenchContext, ttft_requests: int) -> int:
    """Progress units of one ``timed_run``."""
    s = ctx.settings
    units = ctx.workload.output_len if s.throughput else 0
    return units + (_batch1_tokens(ctx) + ttft_requests - 1 if s.ttft else 0)


def resident_mb(device: str) -> float:
    """What the process holds now: its resident memory on CPU, the allocator's tensors on CUDA."""
    if torch.device(device).type == "cuda":
        return torch.cuda.memory_allocated(device) / MB
    import psutil

    return psutil.Process().memory_info().rss / MB


def measure_once(built: Built, ctx: BenchContext, progress: Progress, baseline: bool,
                 held_mb: float = 0.0) -> dict[str, Any]:
    """Warm-ups, peak memory, perplexity and agreement of a contender just built.

    Peak memory is that of its first batch run after the warm-up, as in ``measure_suite``; the
    contenders built before it are still loaded, so what they hold (``held_mb``: the process's
    memory before this build less its memory before any contender was built) is subtracted. The
    figure is then the process's peak as if this contender were the only one loaded.
    """
    model, factory, w, s = built.model, built.factory, ctx.workload, ctx.settings
    prompts = ctx.inputs.prompts

    def step(what: str) -> Callable[[int], None]:
        return lambda _: progress.advance(1, what)

    metrics: dict[str, Any] = {"model_mb": model_mb(model)}
    if s.throughput:
        for _ in range(max(1, w.warmup)):  # one-time work (compiling, first touches) lands in no figure
            generate(model, prompts, w.output_len, factory, on_step=step("P warm-up"))
        memory = PeakMemory(model_device(model))
        with memory:
            generate(model, prompts, w.output_len, factory, on_step=step("peak memory"))
        metrics.update(memory_figures(memory))
        metrics["peak_mem_mb"] = max(0.0, metrics["peak_mem_mb"] - held_mb)
        metrics["peak_mem_others_mb"] = held_mb
        metrics["memory_method"] = metrics.pop("peak_mem_method")
    if s.ttft:
        for _ in range(max(1, w.warmup)):  # batch 1 may run other code than the batch (a step compiled per size)
            generate(model, prompts[:1], _batch1_tokens(ctx), factory, on_step=step("D warm-up"))
    if s.quality and ctx.inputs.eval_blocks is not None:
        metrics.update(evaluate_lm(model, ctx.inputs.eval_blocks, s.eval_batch_size, progress))
    if baseline:
        ctx.reference = make_reference(model, ctx.fidelity_prompts, ctx.fidelity_tokens, factory, progress)
        metrics.update(agreement=1.0, agreement_free=1.0, logits_cosine=1.0, top5_overlap=1.0)
    elif ctx.reference is not None:
        metrics.update(compare_to_reference(model, ctx.reference, factory, progress))
    metrics.update(built.metrics)  # a contender's own figures win (model_mb of a file, compile_s)
    return metrics


# What one round times of each contender: P's request gives the first three, D's the last two.
TIMED_KEYS = ("throughput_tok_s", "prefill_ms_batch", "decode_tok_s_batch", "ttft_ms", "decode_tok_s")
SAMPLES = "_samples"  # beside ttft_ms in a round's figures: each of its requests' first-token times


def ttft_requests(rounds: int) -> int:
    """D requests per round, so that D is the median of at least ``TTFT_SAMPLES`` requests in all."""
    return max(1, math.ceil(TTFT_SAMPLES / max(1, rounds)))


def timed_run(built: Built, ctx: BenchContext, progress: Progress, requests: int, what: str) -> dict[str, Any]:
    """One round's timing of one contender: the P request, then ``requests`` D requests (the first
    generates the workload's output at batch 1 for decode speed, the others one token each)."""
    model, factory, w, s = built.model, built.factory, ctx.workload, ctx.settings
    prompts = ctx.inputs.prompts
    on_step = lambda _: progress.advance(1, what)  # noqa: E731
    figures: dict[str, Any] = {}
    if s.throughput:
        result = generate(model, prompts, w.output_len, factory, on_step=on_step)
        figures.update(throughput_tok_s=result.tok_s, prefill_ms_batch=result.ttft_s * 1000)
        if w.output_len > 1:
            figures["decode_tok_s_batch"] = result.decode_tok_s
    if s.ttft:
        tokens = _batch1_tokens(ctx)
        result = generate(model, prompts[:1], tokens, factory, on_step=on_step)
        firsts = [result.ttft_s * 1000]
        for _ in range(requests - 1):
            firsts.append(generate(model, prompts[:1], 1, factory).ttft_s * 1000)
            progress.advance(1, what)
        figures.update(ttft_ms=statistics.median(firsts), **{"ttft_ms" + SAMPLES: firsts})
        if tokens > 1:
            figures["decode_tok_s"] = result.decode_tok_s
    return figures


RATIO_KEYS = ("throughput_tok_s", "prefill_ms_batch", "decode_tok_s_batch", "ttft_ms", "decode_tok_s", "peak_mem_mb",
              "model_mb", "perplexity")


def judge(rows: list[Row], budget: float) -> None:
    """Ratios to the baseline (the first row) and the accuracy verdict of every measured row.

    A timed figure measured in paired rounds (``<key>_paired`` in the row's metrics) takes its ratio
    from there: the median of the per-round ratios, its interval beside it in ``row.intervals``.
    Other figures (memory, size, perplexity) are the plain quotient.
    """
    base = rows[0].metrics if rows and rows[0].status == "ok" else {}
    for index, row in enumerate(rows):
        if row.status != "ok":
            continue
        for key in RATIO_KEYS:
            paired = row.metrics.get(paired_key(key))
            new, old = row.metrics.get(key), base.get(key)
            if index > 0 and isinstance(paired, dict):
                row.ratios[key] = paired["ratio"]
                row.intervals[key] = {k: paired[k] for k in ("low", "high", "n", "noisy", "repeated") if k in paired}
            elif isinstance(new, (int, float)) and isinstance(old, (int, float)) and old:
                row.ratios[key] = new / old
        if "perplexity" in row.ratios:
            row.ppl_increase = row.ratios["perplexity"] - 1.0
            # A tiny tolerance: the baseline itself (and bit-identical runtimes) must pass a zero budget.
            row.verdict = "within" if row.ppl_increase <= budget + 1e-9 else "over"
