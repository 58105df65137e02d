"""Before/after operator fusion and the pooled KV cache, side by side, in one run.

Variants: ``eager`` (the model as loaded, growing KV cache), ``fused`` (opus.fusion, growing cache),
``fused+pool`` (fused, pooled KV cache: ``--prealloc`` / ``--step``), ``eager+pool``.
For each: fx nodes (summed over traced regions), dispatched aten ops of one prefill and one decode
step, P (tokens/s of ``--batch`` prompts × ``--input-len``, ``--output-len`` new tokens), D (time to
first token, one request), decode tokens/s at batch 1, peak memory of the batch run, the dispatch
share estimate (ops × 1-element-op time / decode-step time) and fidelity to ``eager`` (teacher-forced
greedy exact match through the KV cache, max |Δlogit|).

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python bench/fusion_kv.py --model examples/k3/model \\
        --data 'examples/k3/data/heldout/*.txt' --batch 8 --input-len 128 --output-len 32

Without a model directory it measures an untrained K3-shaped stand-in (said in the output).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing Opus

from opus import fusion  # noqa: E402
from opus.kv.cache import cache_factory  # noqa: E402
from opus.kv.pool import cache_config, default_pool  # noqa: E402
from opus.models import DecoderLM, ModelConfig, load_model  # noqa: E402
from opus.runtime.metrics import measure_latency, measure_throughput  # noqa: E402


def load(args: argparse.Namespace) -> tuple[torch.nn.Module, Any, str]:
    path = ROOT / args.model if not Path(args.model).is_absolute() else Path(args.model)
    if (path / "config.json").is_file():
        model, tok = load_model({"hf": str(path)}, dtype=args.dtype)
        return model, tok, str(path)
    cfg = ModelConfig(family="mixtral", vocab_size=4096, hidden_size=256, intermediate_size=192, num_layers=4,
                      num_heads=8, num_kv_heads=2, head_dim=32, max_position_embeddings=2048, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, num_experts=8, top_k=2, moe_intermediate_size=192)
    torch.manual_seed(0)
    model = DecoderLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.05)
    return model.to(getattr(torch, args.dtype)).eval(), None, f"untrained K3-shaped stand-in ({path} not found)"


def prompts_for(args: argparse.Namespace, model: torch.nn.Module, tok: Any) -> tuple[torch.Tensor, str]:
    from opus.pipeline.spec import TextSetSpec
    from opus.runtime.data import cut_blocks, random_blocks, token_stream

    if tok is not None and args.data:
        stream, where = token_stream(TextSetSpec(files=[args.data]), tok, ROOT)
        return cut_blocks(stream, args.batch, args.input_len, 0, where), "text"
    return random_blocks(args.batch, args.input_len, model.config.vocab_size, 0), "random"


def measure(model: torch.nn.Module, prompts: torch.Tensor, cache: dict | None, ref: Any,
            args: argparse.Namespace) -> dict[str, Any]:
    factory = cache_factory(model, cache)
    row: dict[str, Any] = {"nodes": fusion.region_nodes(model)[0]}
    ops = fusion.lm_op_counts(model, prompts[:1])
    row.update(ops_prefill=ops["prefill"], ops_decode=ops["decode"])
    p = measure_throughput(model, prompts, args.output_len, factory, args.warmup, args.repeats)
    d = measure_latency(model, prompts[:1], args.output_len, factory, args.warmup, args.repeats)
    step = fusion.decode_step_s(model, prompts[:1])
    row.update(P_tok_s=p["throughput_tok_s"], D_ms=d["ttft_ms"], decode_b1_tok_s=d.get("decode_tok_s"),
               peak_mem_mb=p["peak_mem_mb"], decode_step_ms=step * 1e3,
               dispatch_share=fusion.dispatch_share(ops["decode"], step, fusion.trivial_op_s(prompts.device)))
    eq = fusion.compare(model, ref)
    row.update(exact_match=eq["fusion_exact_match"], max_abs_diff=eq["fusion_max_abs_diff"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="examples/k3/model")
    ap.add_argument("--data", default="examples/k3/data/heldout/*.txt")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prealloc", type=int, default=512)
    ap.add_argument("--step", type=int, default=1024)
    ap.add_argument("--json", default=None, help="also write the table here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, source = load(args)
    prompts, prompt_source = prompts_for(args, model, tok)
    ref = fusion.lm_reference(model, prompts[:4, :64], 16)
    fused = copy.deepcopy(model)
    outcome = fusion.fuse_model(fused, fusion.FusionConfig(), fusion.lm_probe(prompts[:1, :16]))
    pool = cache_config(args.prealloc, args.step, min(8192, model.config.max_position_embeddings))
    variants = {"eager": (model, None), "fused": (outcome.model, None), "fused+pool": (outcome.model, pool),
                "eager+pool": (model, pool)}
    table = {name: measure(m, prompts, cache, ref, args) for name, (m, cache) in variants.items()}
    print(f"model: {source}; prompts: {prompt_source}; batch {args.batch} x in {args.input_len} -> out "
          f"{args.output_len}; {args.dtype}; threads {torch.get_num_threads()}; torch {torch.__version__}")
    print("fused sites: " + ", ".join(f"{k} {v['fused']}" for k, v in outcome.patterns().items() if v["fused"])
          + f"; ignored regions: {len(outcome.ignored)}; pool: {default_pool().stats}")
    keys = list(next(iter(table.values())))
    print(f"{'':18}" + "".join(f"{name:>14}" for name in table))
    for key in keys:
        cells = [table[name][key] for name in table]
        print(f"{key:18}" + "".join(f"{c:>14.4g}" if isinstance(c, float) else f"{c!s:>14}" for c in cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"source": source, "args": vars(args), "table": table}, indent=2))


if __name__ == "__main__":
    main()
