"""export: the current model to the formats other tools load, each checked where it lands.

The export directory (default: this stage's ``artifacts/export``) holds the native export
(safetensors + recipe; ``opus.export.native.load_exported(dir)``) and one entry per target:
``hf/`` (Hugging Face + compressed-tensors, loaded back in transformers and its logits compared),
``gguf/`` (the plan's per-tensor GGUF types, for llama.cpp) and the ONNX graph (checked in
onnxruntime: parity, P, D). Each target reports ``<target>_exported`` (1/0, so a gate can require
it) and, when not exported, the reason, as a warning on the console line and in the report; the run
goes on.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from opus.pipeline.context import StageContext, StageResult

VERSION = "1"
ROLE = "export"  # how the run's verdict counts this stage (opus.pipeline.registry.ROLES)
METRICS = frozenset({
    "export_tensors_mb",
    "hf_exported", "hf_file_mb", "hf_loads_in_transformers", "hf_max_abs_diff", "hf_next_token_agreement",
    "hf_logits_cosine", "hf_compared_positions",
    "gguf_exported", "gguf_file_mb",
    "onnx_exported", "onnx_file_mb", "onnx_max_abs_diff", "onnx_next_token_agreement", "onnx_greedy_agreement",
    "onnx_ttft_ms", "onnx_throughput_tok_s"})


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dir: str | None = Field(None, description="export directory, relative to the pipeline file "
                                              "(default: this stage's artifacts/export)")
    onnx: bool = True
    hf: bool = Field(True, description="Hugging Face directory with compressed-tensors (transformers, vLLM)")
    gguf: bool = Field(True, description="GGUF with the plan's per-tensor types (llama.cpp)")
    prompts: list[str] = Field(default_factory=lambda: ["def main():\n", "import os\nimport sys\n",
                                                        "The quick brown fox"], min_length=1)
    greedy_tokens: int = Field(8, ge=1, description="greedy continuation compared torch vs onnxruntime")
    batch_size: int | None = Field(None, gt=0, description="P batch (default: workload.batch_size)")
    input_len: int | None = Field(None, gt=0, description="P and D input length (default: workload.input_len)")
    new_tokens: int = Field(4, gt=0, description="tokens the no-cache greedy loop generates for P")
    last_only: bool = Field(True, description="export next-token logits only, when the model supports it")
    threads: int | None = Field(None, gt=0, description="onnxruntime intra-op threads (default: run.threads)")
    compare_blocks: int = Field(8, ge=0, description="held-out text blocks (data.evaluation) on which the HF "
                                                     "export's logits are compared with Opus's, every position; "
                                                     "0, or no evaluation data: the prompts")


def _held_out(ctx: StageContext, tokenizer: Any, count: int) -> list[Any]:
    """The first ``count`` blocks of the pipeline's evaluation text, one row each (none without it)."""
    from opus.runtime.data import DataError, load_blocks

    evaluation = ctx.spec.data.evaluation
    if not count or evaluation is None or tokenizer is None:
        return []
    try:
        blocks = load_blocks(evaluation, tokenizer, ctx.base_dir)
    except DataError as exc:
        ctx.log(f"the HF export is compared on the export prompts: {exc}")
        return []
    return [row.unsqueeze(0) for row in blocks[:count]]


def run(ctx: StageContext, cfg: Config) -> StageResult:
    from opus.atomic import relative_path
    from opus.export.native import export_model
    from opus.export.settings import ExportSettings
    from opus.runtime.machine import thread_count

    loaded = ctx.load_model()
    workload, spec = ctx.workload, ctx.spec
    final = (ctx.base_dir / cfg.dir) if cfg.dir else ctx.artifact_dir / "export"
    settings = ExportSettings(
        source=loaded.state["source"], base_dir=ctx.base_dir, dtype=spec.model.dtype, device=spec.model.device,
        onnx=cfg.onnx, hf=cfg.hf, gguf=cfg.gguf, prompts=list(cfg.prompts), greedy_tokens=cfg.greedy_tokens,
        batch_size=cfg.batch_size or workload.batch_size, input_len=cfg.input_len or workload.input_len,
        new_tokens=cfg.new_tokens, warmup=workload.warmup, repeats=workload.repeats,
        threads=cfg.threads or thread_count(spec.run.threads), last_only=cfg.last_only,
        progress=lambda what, done=0, total=None: ctx.progress(done, total, what), compiling=ctx.compiling,
        held_out=_held_out(ctx, loaded.tokenizer, cfg.compare_blocks))
    metrics, info = export_model(loaded.model, loaded.tokenizer, loaded.state, final, settings)
    # Inside the checkpoint the directory is still temporary: record where it will be once committed.
    # No absolute path in a run file: a ``dir`` export is named relative to the run directory.
    info["export_dir"] = (relative_path(final, ctx.run_dir) if cfg.dir
                          else f"{ctx.stage_id} checkpoint: artifacts/export")
    from opus.export.targets import EXPORTS_FILE

    ctx.write_artifact(EXPORTS_FILE, {"export_dir": info["export_dir"], "targets": info["targets"]})
    warnings = []
    for name, target in info["targets"].items():
        if not target["exported"]:
            ctx.log(f"{name}: not exported: {target['reason']}")
            warnings.append(f"{name} not exported ({target['reason']})")
    return StageResult(metrics=metrics, info=info, warnings=warnings)
