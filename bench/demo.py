"""Side-by-side speed, memory and perplexity of one checkpoint under several runtimes, in one run.

Variants (``--variants``, the first is the reference for the ratios):

- ``hf``        transformers eager ``generate`` (greedy, its own dynamic KV cache)
- ``opus``      Opus's own decoder through ``opus.runtime.engine`` (growing KV cache), float32
- ``opus-bf16`` the same in bfloat16

For each: P (generated tokens/s of ``--batch`` prompts of ``--input-len`` tokens, ``--output-len``
new tokens each), D (time to first token of one request of ``--input-len`` tokens), decode tokens/s at
batch 1, peak memory while the batch workload runs (and its rise over the resident model), model
bytes, and perplexity / top-1 on the evaluation text. Prompts are cut from the same text.

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python bench/demo.py --model examples/k3/model \\
        --data 'examples/k3/data/heldout/*.txt' --batch 8 --input-len 256 --output-len 64
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing Opus

from opus.kv.cache import cache_factory  # noqa: E402
from opus.pipeline.spec import TextSetSpec  # noqa: E402
from opus.runtime.data import cut_blocks, token_stream  # noqa: E402
from opus.runtime.engine import generate  # noqa: E402
from opus.runtime.metrics import PeakMemory, evaluate_lm, model_mb  # noqa: E402

ROWS = (("throughput_tok_s", "P  tok/s", "{:.1f}", True), ("ttft_ms", "D  ms", "{:.1f}", False),
        ("decode_tok_s", "decode b1 tok/s", "{:.1f}", True), ("peak_mem_mb", "peak RSS MB", "{:.0f}", False),
        ("peak_mem_rise_mb", "workload rise MB", "{:.1f}", False), ("model_mb", "model MB", "{:.1f}", False),
        ("perplexity", "perplexity", "{:.3f}", False), ("top1_accuracy", "top-1", "{:.4f}", True))


# -- runtimes: (load, run one request) ---------------------------------------------------------
class Timed:
    def __init__(self, ttft_s: float, total_s: float, new_tokens: int) -> None:
        self.ttft_s, self.total_s, self.new_tokens = ttft_s, total_s, new_tokens


def load_variant(name: str, model_dir: Path) -> tuple[Any, Any, Callable[..., Timed]]:
    if name == "hf":
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # keep the table readable

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)

        def hf_generate(prompts: torch.Tensor, new: int) -> float:
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                               max_new_tokens=new, min_new_tokens=new, pad_token_id=tokenizer.eos_token_id)
            return time.perf_counter() - start

        def run_hf(prompts: torch.Tensor, new: int, ttft: bool = False) -> Timed:
            # generate has no first-token hook: D is a separate one-token call.
            first = hf_generate(prompts, 1) if ttft else float("nan")
            return Timed(first, hf_generate(prompts, new), prompts.shape[0] * new)

        return model, tokenizer, run_hf
    if name in ("opus", "opus-bf16"):
        from opus.models import load_model

        dtype = "bfloat16" if name == "opus-bf16" else "float32"
        model, tokenizer = load_model({"hf": str(model_dir)}, ".", dtype=dtype)
        factory = cache_factory(model)

        def run_opus(prompts: torch.Tensor, new: int, ttft: bool = False) -> Timed:
            result = generate(model, prompts, new, factory)
            return Timed(result.ttft_s, result.total_s, result.new_tokens)

        return model, tokenizer, run_opus
    raise SystemExit(f"unknown variant '{name}' (known: hf, opus, opus-bf16)")


# -- one variant --------------------------------------------------------------------------------
def measure(name: str, args: argparse.Namespace, prompts: torch.Tensor, blocks: torch.Tensor) -> dict[str, float]:
    model, _, run = load_variant(name, args.model)
    out: dict[str, float] = {"model_mb": model_mb(model)}
    memory = PeakMemory("cpu")
    with memory:  # the first, untimed run doubles as warm-up
        run(prompts, args.output_len)
    for _ in range(max(0, args.warmup - 1)):
        run(prompts, args.output_len)
    batch = [run(prompts, args.output_len) for _ in range(args.repeats)]
    out["throughput_tok_s"] = statistics.median(r.new_tokens / r.total_s for r in batch)
    out["peak_mem_mb"], out["peak_mem_rise_mb"] = memory.peak_mb, memory.rise_mb
    run(prompts[:1], args.output_len)  # warm the batch-1 shapes
    single = [run(prompts[:1], args.output_len, ttft=True) for _ in range(args.repeats)]
    out["ttft_ms"] = statistics.median(r.ttft_s for r in single) * 1000
    # A request is prefill + first token (ttft) + output_len - 1 decode steps.
    out["decode_tok_s"] = statistics.median((args.output_len - 1) / (r.total_s - r.ttft_s) for r in single)
    out.update(evaluate_lm(model, blocks, batch_size=4))
    del model, run
    gc.collect()  # the next variant's memory figures should not include this one
    return out


def table(results: dict[str, dict[str, float]]) -> str:
    names = list(results)
    ref = results[names[0]]
    head = f"{'':<18}" + "".join(f"{n:>14}" for n in names) + "".join(f"{n + '/' + names[0]:>18}" for n in names[1:])
    lines = [head]
    for key, label, fmt, _ in ROWS:
        cells = "".join(f"{fmt.format(results[n][key]):>14}" if key in results[n] else f"{'-':>14}" for n in names)
        ratios = "".join(f"{results[n][key] / ref[key]:>17.3f}x" if ref.get(key) else f"{'-':>18}"
                         for n in names[1:])
        lines.append(f"{label:<18}{cells}{ratios}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "examples/k3/model")
    ap.add_argument("--data", default=str(ROOT / "examples/k3/data/heldout/*.txt"), help="glob of text files")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--eval-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--variants", default="hf,opus", help="comma list of hf, opus, opus-bf16")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"no model at {args.model} (train it: python examples/k3/train.py)")
    if args.output_len < 2:
        raise SystemExit("--output-len must be at least 2 (decode speed needs a decode step)")
    if args.threads:
        torch.set_num_threads(args.threads)
    from opus.models import load_model

    _, tokenizer = load_model({"hf": str(args.model)}, ".")
    text = TextSetSpec(files=[args.data], samples=args.eval_samples, seq_len=args.eval_len)
    stream, where = token_stream(text, tokenizer, Path.cwd())
    blocks = cut_blocks(stream, args.eval_samples, args.eval_len, 0, where)
    prompts = cut_blocks(stream, args.batch, args.input_len, 1, where)
    print(f"model {args.model}  batch {args.batch}  input {args.input_len}  output {args.output_len}  "
          f"threads {torch.get_num_threads()}  torch {torch.__version__}", flush=True)
    results = {}
    for name in args.variants.split(","):
        started = time.monotonic()
        results[name] = measure(name.strip(), args, prompts, blocks)
        print(f"  {name}: measured in {time.monotonic() - started:.0f} s", flush=True)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
