"""A compiled decode step with a MoE layer's experts' gate/up in one call against one call per expert.

The dense mode (what a compiled decode step runs, opus.fusion.moe) runs every expert on every row. With
quantized experts it ran each expert's gate/up layer apart: E int8 GEMM calls a layer, each quantizing the
same rows. Since every expert sees the same rows there, ``GroupedExperts.gate_up_all`` holds all E layers
concatenated (exact) and runs them as one. This bench quantizes and fuses the model as a pipeline would
(``bench/compiled_prefill.py``'s ``optimized``), copies it, takes the merged layers out of the copy, and
times ``--steps`` decode steps of each through a static cache (compiled steps, ``--kv-dtype``) after one
prompt of ``--input-len`` tokens, in ``--rounds`` interleaved rounds. It prints each round's step time,
the medians, the per-round ratio and whether the two decoded the same tokens. A figure, not a test:

    HF_HUB_OFFLINE=1 .venv/bin/python bench/dense_gate_up.py --batch 32 --rounds 7
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from compiled_prefill import model_and_calibration, optimized  # noqa: E402

from opus.fusion.moe import grouped_moes  # noqa: E402
from opus.kv import static  # noqa: E402
from opus.kv.cache import cache_factory  # noqa: E402
from opus.runtime.machine import describe, recorded  # noqa: E402


def decode_steps(model: torch.nn.Module, cache: dict, prompts: torch.Tensor, steps: int) -> tuple[float, torch.Tensor]:
    """Milliseconds per decode step after one prompt, and the greedy tokens decoded."""
    batch, length = prompts.shape
    made = cache_factory(model, cache)(batch, length + steps)
    with torch.inference_mode():
        token = model(prompts, cache=made, start_pos=0, last_only=True)[:, -1].argmax(-1, keepdim=True)
        tokens = []
        started = time.perf_counter()
        for i in range(steps):
            token = model(token, cache=made, start_pos=length + i, last_only=True)[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
        return (time.perf_counter() - started) / steps * 1e3, torch.cat(tokens, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="examples/k3/model")
    parser.add_argument("--calib", default="examples/k3/data/calib/*.txt")
    parser.add_argument("--format", default="w8a8")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--kv-dtype", default="int8", choices=["none", "bfloat16", "int8"])
    args = parser.parse_args()
    base, _, calib = model_and_calibration(args.model, args.calib, "dense_gate_up")
    merged = optimized(base, calib, args.format, "compiled")
    apart = copy.deepcopy(merged)
    layers = grouped_moes(apart)
    if not layers or all(moe.experts.gate_up_all is None for _, moe in layers):
        print(f"dense_gate_up: {args.model}: no MoE layer whose quantized experts' gate/up merged ({args.format})",
              file=sys.stderr)
        raise SystemExit(2)
    for _, moe in layers:
        moe.experts.gate_up_all = None
    prompts = calib[:1].repeat(args.batch, -(-args.input_len // calib.shape[1]))[:, :args.input_len]
    cache = static.cache_config(True, attention="blocked", kv_dtype=None if args.kv_dtype == "none" else args.kv_dtype)
    models = {"one call": merged, "a call per expert": apart}
    times: dict[str, list[float]] = {name: [] for name in models}
    tokens: dict[str, torch.Tensor] = {}
    record: dict = {}
    with recorded(record):
        for model in models.values():  # compiles each step graph outside the rounds
            decode_steps(model, cache, prompts, 4)
        for _ in range(args.rounds):
            for name, model in models.items():
                ms, tokens[name] = decode_steps(model, cache, prompts, args.steps)
                times[name].append(ms)
    print(describe(record["machine"]))
    print(f"{args.model}: {args.format} + fusion, static cache (compiled steps, {args.kv_dtype} K/V), batch "
          f"{args.batch}, prompt {args.input_len}, {args.steps} decode steps, {args.rounds} interleaved rounds")
    for name, values in times.items():
        print(f"{name:>18}: step ms {', '.join(f'{v:.2f}' for v in values)}; median {statistics.median(values):.2f}")
    ratios = [a / b for a, b in zip(times["one call"], times["a call per expert"])]
    print(f"per-round ratio one call / a call per expert: median {statistics.median(ratios):.3f} "
          f"[{min(ratios):.3f}–{max(ratios):.3f}]; same tokens: {torch.equal(*tokens.values())}")


if __name__ == "__main__":
    main()
