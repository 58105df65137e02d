"""What fusion changes, counted: fx nodes per region, dispatched aten ops per forward, dispatch share.

- Dispatched ops: every aten op that reaches the dispatcher's Python mode (``TorchDispatchMode``)
  during one prefill and one decode step. Composite ops that PyTorch keeps whole at that level
  (``aten::linear``, ``aten::rms_norm``) count once.
- Dispatch share (an estimate, said how): ``ops per decode step × cost of one trivial op`` over the
  wall time of a decode step. The trivial op is a 1-element ``add`` timed from Python, i.e. the
  time of the same op count at tiny size; module-call overhead is not included, so it is a floor.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from opus.fusion.tracing import node_count, regions, try_trace
from opus.kv.cache import GrowingKVCache
from opus.runtime.timed_choice import wall_clock


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], Any]) -> Counter[str]:
    with torch.inference_mode(), OpCounter() as counter:
        fn()
    return counter.ops


def lm_op_counts(model: nn.Module, input_ids: torch.Tensor) -> dict[str, int]:
    """Dispatched ops of one prefill (into a growing cache) and of the decode step after it."""
    cache = GrowingKVCache(getattr(getattr(model, "config", None), "num_layers", None))
    with torch.inference_mode():
        prefill = count_ops(lambda: model(input_ids, cache=cache, start_pos=0, last_only=True))
        nxt = input_ids[:, -1:]
        decode = count_ops(lambda: model(nxt, cache=cache, start_pos=input_ids.shape[1], last_only=True))
    return {"prefill": sum(prefill.values()), "decode": sum(decode.values())}


def region_nodes(model: nn.Module) -> tuple[int, int]:
    """(fx nodes summed over traceable regions, number of regions counted)."""
    names = regions(model)
    total = counted = 0
    for name in names:
        gm, _ = try_trace(model, name, names)
        if gm is not None:
            total += node_count(gm)
            counted += 1
    return total, counted


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    return statistics.median(wall_clock(fn) for _ in range(repeats))


def trivial_op_s(device: torch.device) -> float:
    a = torch.ones(1, device=device)
    with torch.inference_mode():
        for _ in range(20):
            torch.add(a, a)
        return _median_s(lambda: [torch.add(a, a) for _ in range(100)], 7) / 100


def decode_step_s(model: nn.Module, input_ids: torch.Tensor, steps: int = 8) -> float:
    """Median wall time of a decode step after a prefill of ``input_ids`` (growing cache)."""
    cache = GrowingKVCache(getattr(getattr(model, "config", None), "num_layers", None))
    pos = input_ids.shape[1]
    tok = input_ids[:, -1:]
    times = []
    with torch.inference_mode():
        model(input_ids, cache=cache, start_pos=0, last_only=True)
        for i in range(steps + 2):
            t = wall_clock(lambda p=pos + i: model(tok, cache=cache, start_pos=p, last_only=True))
            if i >= 2:  # the first steps warm up allocator and caches
                times.append(t)
    return statistics.median(times)


def dispatch_share(decode_ops: int, step_s: float, op_s: float) -> float:
    return min(1.0, decode_ops * op_s / step_s) if step_s > 0 else float("nan")
