"""export: the current model to ONNX (checked in onnxruntime: parity, P, D) and to safetensors + recipe.

The export directory (default: this stage's ``artifacts/export``) reloads without the run directory
through ``opus.export.native.load_exported(dir)``. A model ONNX cannot express (e.g. a custom quantized
module) gives ``onnx_exported: 0`` and the reason in the stage info; the run goes on. ONNX P is a
greedy loop without a KV cache (``new_tokens`` tokens), D one full forward of ``input_len`` tokens.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from opus.pipeline.context import StageContext, StageResult

VERSION = "1"
ROLE = "export"  # how the run's verdict counts this stage (opus.pipeline.registry.ROLES)
METRICS = frozenset({"export_tensors_mb", "onnx_exported", "onnx_file_mb", "onnx_max_abs_diff",
                     "onnx_next_token_agreement", "onnx_greedy_agreement", "onnx_ttft_ms",
                     "onnx_throughput_tok_s"})


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dir: str | None = Field(None, description="export directory, relative to the pipeline file "
                                              "(default: this stage's artifacts/export)")
    onnx: bool = True
    prompts: list[str] = Field(default_factory=lambda: ["def main():\n", "import os\nimport sys\n",
                                                        "The quick brown fox"], min_length=1)
    greedy_tokens: int = Field(8, ge=1, description="greedy continuation compared torch vs onnxruntime")
    batch_size: int | None = Field(None, gt=0, description="P batch (default: workload.batch_size)")
    input_len: int | None = Field(None, gt=0, description="P and D input length (default: workload.input_len)")
    new_tokens: int = Field(4, gt=0, description="tokens the no-cache greedy loop generates for P")
    last_only: bool = Field(True, description="export next-token logits only, when the model supports it")
    threads: int | None = Field(None, gt=0, description="onnxruntime intra-op threads (default: run.threads)")


def run(ctx: StageContext, cfg: Config) -> StageResult:
    from opus.export.native import ExportSettings, export_model

    loaded = ctx.load_model()
    workload, spec = ctx.workload, ctx.spec
    final = (ctx.base_dir / cfg.dir) if cfg.dir else ctx.artifact_dir / "export"
    settings = ExportSettings(
        source=loaded.state["source"], base_dir=ctx.base_dir, dtype=spec.model.dtype, device=spec.model.device,
        onnx=cfg.onnx, prompts=list(cfg.prompts), greedy_tokens=cfg.greedy_tokens,
        batch_size=cfg.batch_size or workload.batch_size, input_len=cfg.input_len or workload.input_len,
        new_tokens=cfg.new_tokens, warmup=workload.warmup, repeats=workload.repeats,
        threads=cfg.threads or spec.run.threads, last_only=cfg.last_only,
        progress=lambda what: ctx.progress(0, None, what))
    metrics, info = export_model(loaded.model, loaded.tokenizer, loaded.state, final, settings)
    # Inside the checkpoint the directory is still temporary: record where it will be once committed.
    info["export_dir"] = str(final) if cfg.dir else f"{ctx.stage_id} checkpoint: artifacts/export"
    warnings = []
    if info.get("onnx_error"):
        ctx.log(f"ONNX: {info['onnx_error']}")
        warnings.append(f"ONNX not exported ({info['onnx_error']}); the safetensors + recipe export is "
                        f"there ({info['export_dir']})")
    return StageResult(metrics=metrics, info=info, warnings=warnings)
