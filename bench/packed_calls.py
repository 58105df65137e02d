"""The packed int8 GEMM ops' C++ kernels (opus.quant.cpp_kernels) against Python kernels of the same ops,
called from a compiled graph, side by side in one run.

A compiled function calls ``--layers`` int8 linears (``--rows`` × ``--k`` by ``--n``, one weight each) and
sums their outputs, as a decode step calls its layers. The same function is compiled twice:
once calling ``opus::<kernel>_int8_linear`` (its C++ kernel, built on first use), once calling an op of
the same schema whose kernel is the Python one Opus falls back to (``PackedKernel.run`` on the twin from
the Python table). Both are inductor graphs with the C++ wrapper, as the static cache's steps are.
Interleaved rounds; per call µs (median) and the ratio. A figure, not a test:

    .venv/bin/python bench/packed_calls.py                       # the 135M shape's 576 x 576 at one row
    .venv/bin/python bench/packed_calls.py --rows 512 --k 256 --n 384 --kernel onednn   # K3's expert at prefill
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opus.quant import fbgemm, native, onednn, packed  # noqa: E402, F401 - importing a kernel registers it
from opus.runtime.machine import describe, recorded  # noqa: E402
from opus.runtime.timed_choice import Option, interleave  # noqa: E402

_BENCH = torch.library.Library("opus_bench", "DEF")


def python_op(kernel: packed.PackedKernel) -> Any:
    """An op like ``opus::<kernel>_int8_linear`` whose CPU kernel is the Python one."""
    name = f"{kernel.name}_python"
    _BENCH.define(f"{name}(Tensor q, Tensor qweight, Tensor scale) -> Tensor")
    _BENCH.impl(name, kernel.python_kernel, "CPU")
    torch.library.register_fake(f"opus_bench::{name}", lib=_BENCH)(
        lambda q, qweight, scale: q.new_empty((q.shape[0], qweight.shape[0]), dtype=torch.float32))
    return getattr(torch.ops.opus_bench, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=sorted(packed.KERNELS), default="fbgemm")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--k", type=int, default=576)
    parser.add_argument("--n", type=int, default=576)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    kernel = packed.kernel_named(args.kernel)
    reason = kernel.available() or native.load()
    if reason:
        sys.exit(f"bench/packed_calls.py: {reason}")
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randint(-127, 128, (args.n, args.k), dtype=torch.int8, generator=generator)
               for _ in range(args.layers)]
    scales = [torch.rand(args.n, generator=generator) + 0.5 for _ in range(args.layers)]
    x = torch.randint(-127, 128, (args.rows, args.k), dtype=torch.int8).to(kernel.takes)

    def chain(op: Any) -> Any:
        def run(x: torch.Tensor) -> torch.Tensor:
            return sum(op(x, weight, scale) for weight, scale in zip(weights, scales))
        return torch.compile(run, fullgraph=True, options={"cpp_wrapper": True})

    with packed.use(kernel.name):
        contenders = {"Python kernel": chain(python_op(kernel)),
                      "C++ kernel": chain(getattr(torch.ops.opus, f"{kernel.name}_int8_linear"))}
        outputs = [fn(x) for fn in contenders.values()]  # compiles
        record: dict = {}
        with recorded(record):
            options = [Option(name, lambda fn=fn: [fn(x) for _ in range(10)]) for name, fn in contenders.items()]
            rounds = interleave(options, args.repeats, warmup=0)
    times = {name: [s / 10 / args.layers for s in taken] for name, taken in rounds.items()}
    print(describe(record["machine"]))
    print(f"{kernel.label}'s packed int8 GEMM in a compiled graph of {args.layers} calls: {args.rows} x {args.k} by "
          f"{args.n}; median of {args.repeats} interleaved rounds; outputs equal: {torch.equal(*outputs)}")
    base = statistics.median(times["Python kernel"])
    for name, taken in times.items():
        median = statistics.median(taken)
        print(f"  {name:14s} {median * 1e6:8.2f} us a call  x{median / base:.2f}")


if __name__ == "__main__":
    main()
