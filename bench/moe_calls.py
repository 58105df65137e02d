"""The compiled MoE experts at prefill: one compiled call per layer for all its experts against one call per
expert (what the ``compiled`` mode did before), side by side in one run.

The K3 demo model, quantized W8A8 and fused as ``bench/compiled_prefill.py`` does, its experts in the
``compiled`` mode at prefill; the static cache's compiled prefill (blocked attention, oneDNN's packed
GEMMs) runs ``--batch`` prompts of ``--input-len`` tokens. The two contenders differ only in whether
opus.fusion.compiled_experts may run a layer's experts in one call. Interleaved rounds; median ms of
the prefill, the ratio per round (median and range), and the largest difference of the two prefills'
logits (the sums are the same, so it should be 0). A figure, not a test:

    HF_HUB_OFFLINE=1 .venv/bin/python bench/moe_calls.py --batch 1 --repeats 21
    HF_HUB_OFFLINE=1 .venv/bin/python bench/moe_calls.py --batch 32 --repeats 9
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compiled_prefill import k3_prefill_setup, optimized  # noqa: E402

from opus.fusion import compiled_experts  # noqa: E402
from opus.kv import static  # noqa: E402
from opus.kv.cache import cache_factory  # noqa: E402
from opus.runtime.machine import describe, recorded  # noqa: E402
from opus.runtime.timed_choice import Option, interleave  # noqa: E402

ONE_CALL = compiled_experts._one_call


def main() -> None:
    args, base, calib, prompts = k3_prefill_setup(__doc__.splitlines()[0])
    model = optimized(base, calib, "w8a8", "compiled")
    make = cache_factory(model, static.cache_config(True, compile_prefill=True, attention="blocked",
                                                    kernels={"w8a8_weight_only_rows": 1,
                                                             "w8a8_packed_gemm": "prefill"}))
    contenders = {"one call per expert": lambda *_: False, "one call per layer": ONE_CALL}

    def prefill(one_call: object) -> torch.Tensor:
        compiled_experts._one_call = one_call
        return model(prompts, cache=make(args.batch, args.input_len + 1), start_pos=0, last_only=True)

    logits = [[prefill(rule) for _ in range(3)][-1] for rule in contenders.values()]  # compiles, warms
    record: dict = {}
    with recorded(record):
        times = interleave([Option(name, lambda rule=rule: prefill(rule)) for name, rule in contenders.items()],
                           args.repeats, warmup=0)
    compiled_experts._one_call = ONE_CALL
    print(describe(record["machine"]))
    print(f"K3 W8A8, compiled prefill of {args.batch} x {args.input_len} tokens, experts in the compiled mode; "
          f"{args.repeats} interleaved rounds; largest |Δ logit| {float((logits[0] - logits[1]).abs().max()):.3g}")
    (before, after) = times.values()
    for name, taken in times.items():
        print(f"  {name:22s} {statistics.median(taken) * 1e3:8.2f} ms")
    ratios = [b / a for a, b in zip(before, after)]
    print(f"  ratio per round: median x{statistics.median(ratios):.3f}, range x{min(ratios):.3f}–x{max(ratios):.3f}")


if __name__ == "__main__":
    main()
