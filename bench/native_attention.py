"""The blocked causal attention at prefill as one C++ op (opus.models.native_attention) against the same
kernel as torch ops and against torch's own attention, inside the static cache's compiled prefill, side by
side in one run.

The K3 demo model, quantized W8A8 and fused as ``bench/compiled_prefill.py`` does (experts in the sorted
mode); four contenders run the same ``--batch`` prompts of ``--input-len`` tokens: fp32 eager (the
baseline's prefill), and the compiled prefill with torch's attention (``sdpa``), with the blocked kernel as
torch ops (the C++ op turned off while that graph is traced), with the blocked kernel's C++ op, and with its
bf16 variant (kernel ``blocked_bf16``: Q, K, V and the softmax weights rounded to bfloat16 for the two
products; lossy, which the largest logit difference shows; on CPUs with AVX-512 BF16 only).
Interleaved rounds; median ms, each contender's ratio to fp32 per round (median and range), and the largest
difference of each prefill's logits from the ``sdpa`` one's. A figure, not a test:

    HF_HUB_OFFLINE=1 .venv/bin/python bench/native_attention.py --batch 1 --repeats 21
    HF_HUB_OFFLINE=1 .venv/bin/python bench/native_attention.py --batch 32 --repeats 5
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compiled_prefill import k3_prefill_setup, optimized  # noqa: E402

from opus.kv import static  # noqa: E402
from opus.kv.cache import cache_factory  # noqa: E402
from opus.models import native_attention  # noqa: E402
from opus.runtime.machine import describe, recorded  # noqa: E402
from opus.runtime.timed_choice import Option, interleave  # noqa: E402


def main() -> None:
    args, base, calib, prompts = k3_prefill_setup(__doc__.splitlines()[0])
    if (reason := native_attention.load()) is not None:
        print(f"native_attention: the C++ op cannot run here: {reason}", file=sys.stderr)
        raise SystemExit(1)
    model = optimized(base, calib, "w8a8", "sorted")
    contenders = {"sdpa": "sdpa", "blocked, torch ops": "blocked", "blocked, C++ op": "blocked",
                  "blocked, C++ op, bf16": "blocked_bf16"}
    if (why := native_attention.bf16_reason(torch.float32, "cpu", base.config.head_dim)) is not None:
        print(f"native_attention: the bf16 contender is left out: {why}", file=sys.stderr)
        del contenders["blocked, C++ op, bf16"]
    ops = {"blocked, C++ op": "opus_attention::causal", "blocked, C++ op, bf16": "opus_attention::causal_bf16"}
    runs = {"fp32 eager": lambda: base(prompts, last_only=True)}
    logits = {}
    for name, kernel in contenders.items():
        copy = optimized(base, calib, "w8a8", "sorted") if name != "blocked, C++ op" else model
        make = cache_factory(copy, static.cache_config(True, compile_prefill=True, attention=kernel))
        runs[name] = lambda copy=copy, make=make: copy(prompts, cache=make(args.batch, args.input_len + 1),
                                                       start_pos=0, last_only=True)
        saved = native_attention._STATE["reason"]
        if name == "blocked, torch ops":  # traced without the op: the graph keeps the kernel's torch ops
            native_attention._STATE["reason"] = "turned off by the bench"
        try:
            logits[name] = [runs[name]().clone() for _ in range(3)][-1]  # compiles, warms (a static output: cloned)
        finally:
            native_attention._STATE["reason"] = saved
    for name in contenders:  # what each graph runs, as traced
        with torch.profiler.profile() as prof:
            runs[name]()
        ran = {event.key for event in prof.key_averages()} & set(ops.values())
        if ran != ({ops[name]} if name in ops else set()):
            print(f"native_attention: {name} ran {sorted(ran) or 'no C++ op'}", file=sys.stderr)
            raise SystemExit(1)
    record: dict = {}
    with recorded(record):
        times = interleave([Option(name, run) for name, run in runs.items()], args.repeats, warmup=1)
    print(describe(record["machine"]))
    print(f"K3 W8A8 + fusion (sorted experts), prefill of {args.batch} x {args.input_len} tokens (compiled: static "
          f"cache); {args.repeats} interleaved rounds")
    for name, taken in times.items():
        ratios = [t / b for t, b in zip(taken, times["fp32 eager"])]
        gap = f"   |Δ logit| vs sdpa {float((logits[name] - logits['sdpa']).abs().max()):.3g}" if name in logits else ""
        print(f"  {name:22s} {statistics.median(taken) * 1e3:8.2f} ms   x{statistics.median(ratios):.3f} of fp32 "
              f"[{min(ratios):.3f}–{max(ratios):.3f}]{gap}")


if __name__ == "__main__":
    main()
