"""Measured kernel speed of each format for each layer shape, on this machine, for the run's workload."""

from __future__ import annotations

import functools
import itertools
import statistics
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opus import compile_watch
from opus.models.layout import DECODER, format_group
from opus.quant.formats import FORMATS
from opus.runtime.timed_choice import DEFAULT_ROUNDS, Option, interleave, reported, wall_clock

MAX_ROWS = 2048  # larger row counts are timed at this size and scaled: GEMM time is linear in rows
COLD_BYTES = 32 << 20  # float weight bytes cycled through per timing: more than the CPU's caches
COLD_COPIES_MAX = 64
# A MoE layer's experts' gate/up are merged into one GEMM for the dense mode (opus.fusion.linear_ops) up to
# this many weight bytes: a second copy of the weights, worth it for small experts, whose decode step pays
# for GEMM calls rather than bytes (K3's gate/up: 0.75 MiB a layer).
MERGED_EXPERTS_MAX_BYTES = 32 << 20
# Graphs the compiled kernel caller may hold while the planner times (formats x kernels x shape variants).
KERNEL_GRAPHS_MAX = 128


@dataclass(frozen=True)
class Shape:
    in_features: int
    out_features: int
    rows: int


def _run_kernel(x: torch.Tensor, fn: Any, tensors: tuple) -> torch.Tensor:
    return fn(x, *tensors)


@functools.cache
def _compiled_kernel() -> Any:
    """One compiled caller for every layer kernel, dynamic in its shapes: a graph per kernel function,
    not per shape (the planner times many shapes)."""
    compile_watch.watch()
    return torch.compile(_run_kernel, dynamic=True, fullgraph=True)


def _kernel(layer: nn.Module, rows: int) -> tuple[Any, tuple] | None:
    """The layer's pure kernel at ``rows`` rows (QuantLinear.kernel; ``F.linear`` for a float linear), or None."""
    if type(layer) is nn.Linear:
        # Plain tensors, not Parameters: dynamo keeps a Parameter's shape static (one graph per shape),
        # and a real model's planner times more shapes than dynamo's recompile limit (8).
        return F.linear, (layer.weight.detach(), None if layer.bias is None else layer.bias.detach())
    kernel = getattr(layer, "kernel", None)
    return kernel(rows) if kernel is not None else None


@torch.inference_mode()
def time_formats(formats: list[str], shape: Shape, device: str, dtype: torch.dtype, group_size: int,
                 rounds: int = DEFAULT_ROUNDS, compiled: bool = False) -> dict[str, list[float]]:
    """Milliseconds of one forward of a layer of ``shape`` in each format, per interleaved round.

    Each round calls, per format, copies of the layer in turn, enough over all rounds to exceed the
    CPU caches: in a real decode step every weight comes from memory, not from cache — and that is
    where narrow weights pay off. A single cache-hot layer would favour float weights. A round's
    figure is the median of its calls (a call caught by another process is not counted); the formats
    take turns round by round (``opus.runtime.timed_choice``), so that the machine's slow moments hit them alike.

    ``compiled``: the model will run compiled (fused, in the static cache's compiled steps), so a format
    whose layer has a pure kernel at this row count is also timed through inductor, and each round keeps
    the faster of its two ways. Eagerly, W8A8's activation quantization is several passes over memory
    that a compiled graph fuses into one: on K3's experts (Intel Xeon, AMX) eager W8A8 was slower than
    fp32 and compiled it was ~1.8× faster.
    """
    rows = min(shape.rows, MAX_ROWS)
    weight_bytes = shape.in_features * shape.out_features * torch.finfo(dtype).bits // 8
    copies = max(1, min(COLD_COPIES_MAX, -(-COLD_BYTES // weight_bytes)))
    x = torch.randn(rows, shape.in_features, device=device, dtype=dtype)
    # Every copy is timed cold twice over all rounds, as many calls as a single timing used to take.
    calls = max(2, -(-max(7, 2 * copies) // rounds))

    def options(fmt: str) -> list[Option]:
        layers = [FORMATS[fmt].build(nn.Linear(shape.in_features, shape.out_features, bias=False, device=device,
                                               dtype=dtype), group_size) for _ in range(copies)]
        turn = itertools.cycle(layers)
        eager = Option(fmt, lambda: statistics.median(wall_clock(lambda: next(turn)(x)) for _ in range(calls)))
        kernels = [_kernel(layer, rows) for layer in layers] if compiled else [None]
        if any(k is None for k in kernels):
            return [eager]
        run, kernel_turn = _compiled_kernel(), itertools.cycle(kernels)

        def call() -> torch.Tensor:
            fn, tensors = next(kernel_turn)
            return run(x, fn, tensors)

        # Compiles outside the timed rounds, each copy's kernel called once (one that needs a graph of its own
        # gets it here, not in a timed round). The limit is the planner's: every format's kernels, at every
        # shape and row count, pass through this one caller (dynamo's default: 8 graphs a function).
        with torch._dynamo.config.patch(recompile_limit=KERNEL_GRAPHS_MAX):
            for _ in kernels:
                call()
        return [eager, Option(f"{fmt} compiled", lambda: statistics.median(wall_clock(call) for _ in range(calls)))]

    samples = interleave([o for fmt in formats for o in options(fmt)], rounds, timer=reported)
    scale = 1e3 * shape.rows / rows  # scaled to the shape's row count
    return {fmt: [min(pair) * scale for pair in zip(samples[fmt], samples.get(f"{fmt} compiled", samples[fmt]))]
            for fmt in formats}


class KernelTimer:
    """Caches timings by (format, shape): many layers share a shape."""

    def __init__(self, device: str, dtype: torch.dtype, group_size: int, rounds: int = DEFAULT_ROUNDS,
                 compiled: bool = False) -> None:
        self.device, self.dtype, self.group_size, self.rounds = device, dtype, group_size, rounds
        self.compiled = compiled  # time_formats' ``compiled``
        self.cache: dict[tuple[str, Shape], list[float]] = {}

    def __call__(self, formats: list[str], shape: Shape) -> dict[str, list[float]]:
        missing = [fmt for fmt in formats if (fmt, shape) not in self.cache]
        if missing:
            for fmt, taken in time_formats(missing, shape, self.device, self.dtype, self.group_size,
                                           self.rounds, self.compiled).items():
                self.cache[(fmt, shape)] = taken
        return {fmt: self.cache[(fmt, shape)] for fmt in formats}


def workload_rows(role: str, workload: Any, experts: int, top_k: int, dense_decode: bool = False) -> tuple[int, int]:
    """Rows a layer sees in one prefill and in one decode step of the workload. An expert sees its share
    of the routed rows, except in ``dense_decode``: the dense mode a compiled decode step runs a MoE in
    (static shapes) gives every expert every row."""
    prefill, decode = workload.batch_size * workload.input_len, workload.batch_size
    if role == "lm_head":  # the engine takes logits of the last prompt position only
        prefill = workload.batch_size
    if role == "experts" and experts:
        prefill = max(1, prefill * top_k // experts)
        decode = decode if dense_decode else max(1, decode * top_k // experts)
    return prefill, decode


def merged_shapes(names: list[str], linears: list[nn.Linear]) -> list[tuple[int, int]]:
    """(in, out) of the GEMMs that will run: layers under one parent in one format group that read one input
    (q/k/v, an expert's gate/up) are merged by the fuse stage into one GEMM with one activation quantization."""
    return [shape for _, shape in _gemms(names, linears)]


def _gemms(names: list[str], linears: list[nn.Linear]) -> list[tuple[str, tuple[int, int]]]:
    """``merged_shapes`` with each GEMM's format group (opus.models.layout.format_group)."""
    by_parent: dict[tuple[str, str], list[nn.Linear]] = {}
    for name, linear in zip(names, linears):
        parent, group = name.rpartition(".")[0], format_group(name)
        # A name outside Opus's decoder layout has no group of its own (format_group returns it): by parent.
        by_parent.setdefault((parent, parent if group == name else group), []).append(linear)
    gemms = []
    for (_, group), members in by_parent.items():
        if len({m.in_features for m in members}) == 1:
            gemms.append((group, (members[0].in_features, sum(m.out_features for m in members))))
        else:
            gemms.extend((group, (m.in_features, m.out_features)) for m in members)
    return gemms


def decode_shapes(names: list[str], linears: list[nn.Linear], role: str, dense_decode: bool) -> list[tuple[int, int]]:
    """(in, out) of the GEMMs a decode step runs for the group: ``merged_shapes``, except that in
    ``dense_decode`` a layer's experts' gate/up all read the same rows and run as one GEMM, where their
    int8 weights fit MERGED_EXPERTS_MAX_BYTES (the dense mode: opus.fusion.moe)."""
    gemms = _gemms(names, linears)
    if not (dense_decode and role == "experts"):
        return [shape for _, shape in gemms]
    gate_up = [shape for group, shape in gemms if group.endswith(f".{DECODER.gate_up_group}")]
    rest = [shape for group, shape in gemms if not group.endswith(f".{DECODER.gate_up_group}")]
    if not gate_up:
        return rest
    merged = (gate_up[0][0], sum(out for _, out in gate_up))
    fits = len({i for i, _ in gate_up}) == 1 and merged[0] * merged[1] <= MERGED_EXPERTS_MAX_BYTES
    return ([merged] if fits else gate_up) + rest


def group_rounds_ms(timer: KernelTimer, formats: list[str], names: list[str], linears: list[nn.Linear], role: str,
                    workload: Any, experts: int, top_k: int, dense_decode: bool = False) -> dict[str, list[float]]:
    """Per format, ``timer.rounds`` figures of the group's GEMM time over the workload (one prefill
    plus output_len decode steps; ``dense_decode``: the steps run compiled, a MoE's experts dense). Each
    shape's rounds are sorted before they are added up, so that the group's median (and quartiles) is
    the sum of its shapes' medians (quartiles): a round in which one shape was slowed does not carry over
    to the others."""
    prefill_rows, decode_rows = workload_rows(role, workload, experts, top_k, dense_decode)
    gemms = [(dims, prefill_rows, 1) for dims in merged_shapes(names, linears)]
    gemms += [(dims, decode_rows, workload.output_len) for dims in decode_shapes(names, linears, role, dense_decode)]
    totals = {fmt: [0.0] * timer.rounds for fmt in formats}
    for dims, rows, weight in gemms:
        for fmt, taken in timer(formats, Shape(*dims, rows)).items():
            totals[fmt] = [t + weight * s for t, s in zip(totals[fmt], sorted(taken))]
    return totals
