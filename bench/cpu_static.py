"""A compiled static-shape decode step on CPU, side by side with the eager engine, in one run.

Batch-1 decode on CPU is bound by per-op dispatch (~1,300 aten calls per K3 step in eager PyTorch).
This measures what removing it is worth: opus.bench.static_path.runner's ``StaticRunner`` (static KV cache, masked
attention over all slots, every expert on every token) with its decode step compiled by inductor
into one C++ wrapper (``cpp_wrapper``), against Opus's eager engine on the same model and prompts.

Variants: ``engine fp32`` (the baseline: eager, growing KV cache); ``static W8A8 eager`` and
``static W8A8 compiled`` (SmoothQuant folded into a copy of the model first, exact in float, then
int8 weights per channel, per-token int8 activations, each expert its own int8 module in the fuse
stage's grouped MoE, opus.fusion.moe); ``static fp32 compiled``. For each, at batch 1
and at ``--batch``: prefill ms and decode tokens/s (median of ``--repeats``), and greedy agreement
with the baseline (teacher-forced: fed the baseline's tokens, does it choose the same next one?).
Compile time is reported apart and excluded from every figure.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/cpu_static.py --batch 8 --input-len 256 --output-len 64
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opus.bench.static_path.runner import StaticRunner  # noqa: E402
from opus.models import load_model  # noqa: E402
from opus.pipeline.spec import TextSetSpec  # noqa: E402
from opus.quant.calibrate import collect_stats  # noqa: E402
from opus.quant.smooth import apply_smoothing, smooth_groups  # noqa: E402
from opus.runtime.data import load_blocks  # noqa: E402
from opus.runtime.engine import generate  # noqa: E402
from opus.runtime.metrics import throughput_figures  # noqa: E402


def static_runner(model: torch.nn.Module, batch: int, capacity: int, quant: str | None,
                  compiled: bool) -> tuple[StaticRunner, float]:
    """A runner (and seconds spent compiling: its first prefill and two decode steps)."""
    # Compiled steps run the experts dense whatever the mode (static shapes); eager decode the grouped mode.
    runner = StaticRunner(model, batch, capacity, quant=quant, decode_experts="dense" if compiled else "grouped")
    if not compiled:
        return runner, 0.0
    import torch._inductor.config as inductor

    inductor.cpp_wrapper = True  # one C++ function per step instead of Python calling each kernel
    runner._decode_body = torch.compile(runner._decode_body, fullgraph=True, dynamic=False)
    started = time.perf_counter()
    runner.generate(torch.zeros(batch, 8, dtype=torch.long), 3)
    return runner, time.perf_counter() - started


def measure(run: Any, prompts: torch.Tensor, new_tokens: int, repeats: int) -> dict[str, float]:
    """Prefill ms and decode tokens/s of ``repeats`` runs after one warm-up, reduced as opus bench and the
    stages reduce theirs (opus.runtime.metrics.throughput_figures: medians of the repeats)."""
    run(prompts, new_tokens)  # warm-up: first-touch allocations, a compiled step's first shapes
    figures = throughput_figures([run(prompts, new_tokens) for _ in range(repeats)], new_tokens)
    return {"prefill_ms": figures["prefill_ms_batch"], "decode_tok_s": figures["decode_tok_s_batch"]}


@torch.no_grad()
def teacher_forced_agreement(runner: StaticRunner, prompts: torch.Tensor, reference: torch.Tensor) -> float:
    runner.prefill(prompts)
    same = int((runner.tokens[:, 0] == reference[:, 0]).sum())
    for i in range(1, reference.shape[1]):
        same += int((runner.decode_step(reference[:, i - 1]) == reference[:, i]).sum())
    return same / reference.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="examples/k3/model")
    parser.add_argument("--calib", default="examples/k3/data/calib/*.txt")
    parser.add_argument("--eval", default="examples/k3/data/heldout/*.txt")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_grad_enabled(False)

    base, tokenizer = load_model({"hf": args.model}, ROOT)
    calib = load_blocks(TextSetSpec(files=[args.calib], samples=16, seq_len=256), tokenizer, ROOT)
    prompts = load_blocks(TextSetSpec(files=[args.eval], samples=args.batch, seq_len=args.input_len),
                          tokenizer, ROOT)
    smoothed = copy.deepcopy(base)
    apply_smoothing(smoothed, collect_stats(base, calib), smooth_groups(smoothed))
    capacity = args.input_len + args.output_len
    variants = [("static W8A8 eager", smoothed, "w8a8", False), ("static W8A8 compiled", smoothed, "w8a8", True),
                ("static fp32 compiled", base, None, True)]
    rows: dict[str, dict[str, Any]] = {}
    for batch in (1, args.batch):
        batch_prompts = prompts[:batch]
        reference = generate(base, batch_prompts, args.output_len).tokens
        row = rows.setdefault("engine fp32", {"compile_s": 0.0})
        row[batch] = {**measure(lambda p, n: generate(base, p, n), batch_prompts, args.output_len, args.repeats),
                      "agreement": 1.0}
        for name, model, quant, compiled in variants:
            try:
                runner, compile_s = static_runner(model, batch, capacity, quant, compiled)
                figures = measure(runner.generate, batch_prompts, args.output_len, args.repeats)
                figures["agreement"] = teacher_forced_agreement(runner, batch_prompts, reference)
            except Exception as exc:  # noqa: BLE001 - no C++ compiler, an op inductor cannot lower: say so
                rows.setdefault(name, {})["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                continue
            row = rows.setdefault(name, {"compile_s": 0.0})
            row["compile_s"] += compile_s
            row[batch] = figures
            print(f"  measured {name} at batch {batch}", file=sys.stderr, flush=True)
    base_rows = rows["engine fp32"]
    print(f"\nK3 ({args.model}), input {args.input_len}, output {args.output_len}, threads "
          f"{torch.get_num_threads()}; ratios against engine fp32 at the same batch")
    print(f"{'variant':<24}{'D ms b1':>9}{'×':>6}{'dec b1 tok/s':>14}{'×':>6}{'prefill ms bN':>15}{'×':>6}"
          f"{'dec bN tok/s':>14}{'×':>6}{'agree b1/bN':>13}{'compile s':>11}")
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:<24}not measured: {row['error']}")
            continue
        one, many, b1, bn = row[1], row[args.batch], base_rows[1], base_rows[args.batch]
        print(f"{name:<24}{one['prefill_ms']:>9.1f}{one['prefill_ms'] / b1['prefill_ms']:>6.2f}"
              f"{one['decode_tok_s']:>14.1f}{one['decode_tok_s'] / b1['decode_tok_s']:>6.2f}"
              f"{many['prefill_ms']:>15.1f}{many['prefill_ms'] / bn['prefill_ms']:>6.2f}"
              f"{many['decode_tok_s']:>14.1f}{many['decode_tok_s'] / bn['decode_tok_s']:>6.2f}"
              f"{one['agreement']:>7.3f}/{many['agreement']:.3f}{row['compile_s']:>11.1f}")


if __name__ == "__main__":
    main()
