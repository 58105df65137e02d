"""What every contender of ``opus bench`` shares: the interface, the inputs, and one measurement.

A contender is a name and a ``build(ctx) -> Built`` function. ``Built.model`` follows the engine's
LM interface (``model(input_ids, cache=None, start_pos=0, last_only=False) -> logits``): an Opus
decoder, or an adapter that puts another runtime (onnxruntime, llama.cpp) behind that interface.
Every contender is then measured by the same code — ``opus.runtime.metrics.measure_suite`` for P, D,
decode speed at batch 1, peak memory and perplexity, and ``compare_to_reference`` for agreement —
so the same workload, prompts and evaluation blocks reach every runtime.

``build`` raises ``Unavailable`` when the contender cannot run here (a missing package, kernel or
device); the row then carries that reason instead of figures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from opus.kv.cache import CacheFactory
from opus.pipeline.spec import WorkloadSpec
from opus.runtime.metrics import (
    Inputs,
    Progress,
    Reference,
    Settings,
    compare_to_reference,
    fidelity_units,
    make_reference,
    measure_suite,
    suite_units,
)


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
    family: str  # torch | transformers | onnxruntime | llama.cpp
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
    ppl_increase: float | None = None
    verdict: str = "n/a"  # within | over | n/a
    seconds: float = 0.0
    detail: str = ""  # the traceback of a failure (JSON only)


def units(ctx: BenchContext) -> int:
    """Progress units (forward passes) of one contender's measurement."""
    return suite_units(ctx.settings, ctx.workload, ctx.eval_samples) + fidelity_units(ctx.fidelity_tokens)


def measure(built: Built, ctx: BenchContext, progress: Progress, baseline: bool) -> dict[str, Any]:
    """P, D, decode b1, memory, perplexity and agreement of one built contender."""
    metrics, info = measure_suite(built.model, ctx.inputs, ctx.workload, ctx.settings, built.factory, progress)
    metrics["memory_method"] = info.get("memory_method", "")
    if baseline:
        ctx.reference = make_reference(built.model, ctx.fidelity_prompts, ctx.fidelity_tokens, built.factory,
                                       progress)
        metrics.update(agreement=1.0, agreement_free=1.0, logits_cosine=1.0, top5_overlap=1.0)
    elif ctx.reference is not None:
        metrics.update(compare_to_reference(built.model, ctx.reference, built.factory, progress))
    metrics.update(built.metrics)  # a contender's own figures win (model_mb of a file, compile_s)
    return metrics


RATIO_KEYS = ("throughput_tok_s", "prefill_ms_batch", "decode_tok_s_batch", "ttft_ms", "decode_tok_s", "peak_mem_mb",
              "model_mb", "perplexity")


def judge(rows: list[Row], budget: float) -> None:
    """Ratios to the baseline (the first row) and the accuracy verdict of every measured row."""
    base = rows[0].metrics if rows and rows[0].status == "ok" else {}
    for row in rows:
        if row.status != "ok":
            continue
        for key in RATIO_KEYS:
            new, old = row.metrics.get(key), base.get(key)
            if isinstance(new, (int, float)) and isinstance(old, (int, float)) and old:
                row.ratios[key] = new / old
        if "perplexity" in row.ratios:
            row.ppl_increase = row.ratios["perplexity"] - 1.0
            # A tiny tolerance: the baseline itself (and bit-identical runtimes) must pass a zero budget.
            row.verdict = "within" if row.ppl_increase <= budget + 1e-9 else "over"
