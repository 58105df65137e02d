"""The MoE experts at prefill as one C++ op (opus.fusion.native_experts) against the compiled mode and the
sorted mode's Python op, inside the static cache's compiled prefill, side by side in one run.

The K3 demo model, quantized W8A8 and fused as ``bench/compiled_prefill.py`` does; four contenders run the
same ``--batch`` prompts of ``--input-len`` tokens: fp32 eager (the baseline's prefill), and the compiled
prefill (blocked attention) with the experts in the ``compiled`` mode, in the ``sorted`` mode through the
C++ op, and in the ``sorted`` mode through its Python op (the C++ op turned off for that model). Interleaved
rounds; median ms, each contender's ratio to fp32 per round (median and range), and the largest difference
of each prefill's logits from the first compiled one's. A figure, not a test:

    HF_HUB_OFFLINE=1 .venv/bin/python bench/native_experts.py --batch 1 --repeats 21
    HF_HUB_OFFLINE=1 .venv/bin/python bench/native_experts.py --batch 32 --repeats 5
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compiled_prefill import k3_prefill_setup, optimized  # noqa: E402

from opus.fusion.moe import grouped_moes  # noqa: E402
from opus.kv import static  # noqa: E402
from opus.kv.cache import cache_factory  # noqa: E402
from opus.runtime.machine import describe, recorded  # noqa: E402
from opus.runtime.timed_choice import Option, interleave  # noqa: E402


def main() -> None:
    args, base, calib, prompts = k3_prefill_setup(__doc__.splitlines()[0])
    compiled = optimized(base, calib, "w8a8", "compiled")
    native = optimized(base, calib, "w8a8", "sorted")
    python_op = optimized(base, calib, "w8a8", "sorted")
    for _, moe in grouped_moes(python_op):
        moe.experts._native_reason = "turned off by the bench"
    reason = grouped_moes(native)[0][1].experts.native_reason(prompts.float())
    if reason is not None:
        print(f"native_experts: the C++ op cannot run here: {reason}", file=sys.stderr)
        raise SystemExit(1)
    config = static.cache_config(True, compile_prefill=True, attention="blocked")

    def prefill_of(model: torch.nn.Module):  # noqa: ANN202 - a closure
        make = cache_factory(model, config)
        return lambda: model(prompts, cache=make(args.batch, args.input_len + 1), start_pos=0, last_only=True)

    runs = {"fp32 eager": lambda: base(prompts, last_only=True), "experts compiled": prefill_of(compiled),
            "experts sorted, C++ op": prefill_of(native), "experts sorted, Python op": prefill_of(python_op)}
    logits = {name: [run().clone() for _ in range(3)][-1] for name, run in runs.items()}  # compiles, warms; cloned
    record: dict = {}
    with recorded(record):
        times = interleave([Option(name, run) for name, run in runs.items()], args.repeats, warmup=0)
    print(describe(record["machine"]))
    print(f"K3 W8A8 + fusion, prefill of {args.batch} x {args.input_len} tokens (compiled: static cache, blocked "
          f"attention); {args.repeats} interleaved rounds")
    first = logits["experts compiled"]
    for name, taken in times.items():
        ratios = [t / b for t, b in zip(taken, times["fp32 eager"])]
        gap = float((logits[name] - first).abs().max())
        print(f"  {name:26s} {statistics.median(taken) * 1e3:8.2f} ms   x{statistics.median(ratios):.3f} of fp32 "
              f"[{min(ratios):.3f}–{max(ratios):.3f}]   |Δ logit| vs compiled experts {gap:.3g}")


if __name__ == "__main__":
    main()
