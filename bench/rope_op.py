"""RoPE in a compiled prompt: cos/sin inline (inductor recomputes them in every kernel that applies them)
against cos/sin from ``opus::rope_cos_sin`` (one opaque op, computed once), side by side in one run.

The compiled function is what a decoder layer's attention does between its QKV GEMM and the cache
write: split q and k from the fused projection, apply RoPE to each head, lay them out per head. Both
contenders compile the same body; only where cos/sin come from differs. Interleaved rounds, median
ms per call and the ratio. A figure, not a test:

    .venv/bin/python bench/rope_op.py                                    # K3: batch 32 x 512, 8 heads on 2, dim 32
    .venv/bin/python bench/rope_op.py --batch 1 --heads 9 --kv-heads 3 --head-dim 64   # the 135M shape
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opus.models.decoder import _cos_sin, apply_rope, rope_cos_sin  # noqa: E402
from opus.runtime.machine import describe, recorded  # noqa: E402
from opus.runtime.timed_choice import Option, interleave  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    b, t, h, kv, d = args.batch, args.tokens, args.heads, args.kv_heads, args.head_dim
    torch.set_grad_enabled(False)
    qkv = torch.randn(b * t, (h + 2 * kv) * d)
    positions = torch.arange(t)

    def layer(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = qkv.view(b, t, -1).split([h * d, kv * d, kv * d], -1)
        q, k = q.view(b, t, h, d).transpose(1, 2), k.view(b, t, kv, d).transpose(1, 2)
        return apply_rope(q, cos, sin).contiguous(), apply_rope(k, cos, sin).contiguous()

    def inline(qkv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return layer(qkv, *_cos_sin(positions, d, 10000.0))

    def opaque(qkv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return layer(qkv, *rope_cos_sin(positions, d, 10000.0))

    contenders = {name: torch.compile(fn, fullgraph=True, dynamic=False)
                  for name, fn in (("cos/sin inline", inline), ("cos/sin from opus::rope_cos_sin", opaque))}
    outputs = [fn(qkv, positions) for fn in contenders.values()]  # compiles
    same = all(torch.allclose(a, b_, atol=1e-5) for a, b_ in zip(*outputs))
    record: dict = {}
    with recorded(record):
        times = interleave([Option(name, lambda fn=fn: fn(qkv, positions)) for name, fn in contenders.items()],
                           args.repeats, warmup=0)
    print(describe(record["machine"]))
    print(f"q and k RoPE of one layer, batch {b} x {t} tokens, {h} query heads on {kv} KV heads, head dim {d}; "
          f"median of {args.repeats} interleaved rounds; outputs agree: {same}")
    base = statistics.median(times["cos/sin inline"])
    for name, taken in times.items():
        median = statistics.median(taken)
        print(f"  {name:34s} {median * 1e3:8.3f} ms  x{median / base:.2f}")


if __name__ == "__main__":
    main()
