"""Measured kernel speed of each format for each layer shape, on this machine, for the run's workload."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from opus.quant.formats import FORMATS

MAX_ROWS = 2048  # larger row counts are timed at this size and scaled: GEMM time is linear in rows
COLD_BYTES = 32 << 20  # float weight bytes cycled through per timing: more than the CPU's caches
COLD_COPIES_MAX = 64


@dataclass(frozen=True)
class Shape:
    in_features: int
    out_features: int
    rows: int


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def time_kernel(fmt: str, shape: Shape, device: str, dtype: torch.dtype, group_size: int,
                repeats: int = 7) -> float:
    """Median milliseconds of one forward of a layer of ``shape`` in ``fmt``.

    Each timed call cycles through enough copies of the layer to exceed the CPU caches: in a real
    decode step every weight comes from memory, not from cache — and that is where narrow weights
    pay off. A single cache-hot layer would favour float weights.
    """
    rows = min(shape.rows, MAX_ROWS)
    weight_bytes = shape.in_features * shape.out_features * torch.finfo(dtype).bits // 8
    copies = max(1, min(COLD_COPIES_MAX, -(-COLD_BYTES // weight_bytes)))
    modules = [FORMATS[fmt].build(nn.Linear(shape.in_features, shape.out_features, bias=False, device=device,
                                            dtype=dtype), group_size) for _ in range(copies)]
    x = torch.randn(rows, shape.in_features, device=device, dtype=dtype)
    for module in modules[:2]:
        module(x)
    samples = []
    for index in range(max(repeats, 2 * copies)):  # every copy timed cold twice
        module = modules[index % copies]
        _sync(device)
        start = time.perf_counter()
        module(x)
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3 * shape.rows / rows


class KernelTimer:
    """Caches timings by (format, shape): many layers share a shape."""

    def __init__(self, device: str, dtype: torch.dtype, group_size: int) -> None:
        self.device, self.dtype, self.group_size = device, dtype, group_size
        self.cache: dict[tuple[str, Shape], float] = {}

    def __call__(self, fmt: str, shape: Shape) -> float:
        key = (fmt, shape)
        if key not in self.cache:
            self.cache[key] = time_kernel(fmt, shape, self.device, self.dtype, self.group_size)
        return self.cache[key]


def workload_rows(role: str, workload: Any, experts: int, top_k: int) -> tuple[int, int]:
    """Rows a layer sees in one prefill and in one decode step of the workload."""
    prefill, decode = workload.batch_size * workload.input_len, workload.batch_size
    if role == "lm_head":  # the engine takes logits of the last prompt position only
        prefill = workload.batch_size
    if role == "experts" and experts:
        prefill, decode = max(1, prefill * top_k // experts), max(1, decode * top_k // experts)
    return prefill, decode


def merged_shapes(names: list[str], linears: list[nn.Linear]) -> list[tuple[int, int]]:
    """(in, out) of the GEMMs that will run: layers under one parent that read one input (q/k/v,
    an expert's gate/up) are merged by the fuse stage into one GEMM with one activation quantization."""
    by_parent: dict[str, list[nn.Linear]] = {}
    for name, linear in zip(names, linears):
        by_parent.setdefault(name.rpartition(".")[0], []).append(linear)
    shapes = []
    for members in by_parent.values():
        if len({m.in_features for m in members}) == 1:
            shapes.append((members[0].in_features, sum(m.out_features for m in members)))
        else:
            shapes.extend((m.in_features, m.out_features) for m in members)
    return shapes


def group_time_ms(timer: KernelTimer, fmt: str, names: list[str], linears: list[nn.Linear], role: str,
                  workload: Any, experts: int, top_k: int) -> float:
    """Time of the group's GEMMs over the workload: one prefill plus output_len decode steps."""
    prefill_rows, decode_rows = workload_rows(role, workload, experts, top_k)
    total = 0.0
    for dims in merged_shapes(names, linears):
        total += timer(fmt, Shape(*dims, prefill_rows))
        total += workload.output_len * timer(fmt, Shape(*dims, decode_rows))
    return total
