"""Recorded inputs and outputs of every region, so each rewrite is checked on the spot.

An LM (Opus's interface) is probed three ways — a prefill without cache, a prefill into a KV
cache, one decode step — so a region is checked on every path the engine takes. A cache passed to a
region is recorded as a frozen snapshot: replaying a call appends to a copy, never to the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from opus.kv.cache import CacheBase, GrowingKVCache


class RecordingCache(GrowingKVCache):
    """The probe's cache: a growing cache whose state a region's recorded call can snapshot."""

    def snapshot(self) -> FrozenCache:
        return FrozenCache({i: (k.clone(), self._v[i].clone()) for i, k in self._k.items()})


class FrozenCache(CacheBase):
    """Replays ``update`` against a fixed past: returns past + new, changes nothing."""

    def __init__(self, past: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.past = past

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self.past:
            return k, v
        pk, pv = self.past[layer]
        return torch.cat((pk, k), dim=2), torch.cat((pv, v), dim=2)

    @property
    def seq_len(self) -> int:
        return min((k.shape[2] for k, _ in self.past.values()), default=0)

    def reset(self) -> None:
        self.past = {}


@dataclass
class Call:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any


@dataclass
class Recording:
    calls: dict[str, list[Call]] = field(default_factory=dict)


def _freeze(value: Any) -> Any:
    if isinstance(value, RecordingCache):
        return value.snapshot()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def record_regions(model: nn.Module, names: list[str], run: Any, per_region: int = 3) -> Recording:
    """Run ``run(model)`` with hooks on ``names``; keep up to ``per_region`` calls of each."""
    rec = Recording()
    pending: dict[str, list[tuple[tuple, dict]]] = {}
    handles = []

    def pre(name: str):  # noqa: ANN202
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if len(rec.calls.get(name, [])) + len(pending.get(name, [])) < per_region:
                pending.setdefault(name, []).append((tree_map(_freeze, args), tree_map(_freeze, kwargs)))
        return hook

    def post(name: str):  # noqa: ANN202
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if pending.get(name):
                a, k = pending[name].pop(0)
                rec.calls.setdefault(name, []).append(Call(a, k, tree_map(_freeze, output)))
        return hook

    for name in names:
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(module.register_forward_hook(post(name), with_kwargs=True))
    try:
        with torch.inference_mode():
            run(model)
    finally:
        for h in handles:
            h.remove()
    return rec


def lm_probe(input_ids: torch.Tensor):  # noqa: ANN201
    """Prefill without cache, prefill into a cache, one decode step."""
    def run(model: nn.Module) -> None:
        model(input_ids)
        cache = RecordingCache(getattr(getattr(model, "config", None), "num_layers", None))
        logits = model(input_ids, cache=cache, start_pos=0, last_only=True)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        model(nxt, cache=cache, start_pos=input_ids.shape[1], last_only=True)
    return run


def call_probe(*inputs: Any):  # noqa: ANN201
    def run(model: nn.Module) -> None:
        model(*inputs)
    return run


def tolerance_for(model: nn.Module, given: float | None) -> float:
    """The relative max diff a rewrite may change an output by: ``given``, else by the model's dtype."""
    if given is not None:
        return given
    param = next(model.parameters(), None)
    return 1e-4 if param is None or param.dtype == torch.float32 else 2e-2


def replay_error(module: nn.Module, calls: list[Call], tolerance: float) -> str | None:
    """None when ``module`` reproduces every recorded call within ``tolerance`` (relative max diff)."""
    with torch.inference_mode():
        for call in calls:
            try:
                got = module(*call.args, **call.kwargs)  # caches were frozen when recorded
            except Exception as exc:  # noqa: BLE001 - a rewrite that cannot run is rejected with why
                return f"rewritten region failed: {type(exc).__name__}: {exc}".splitlines()[0][:300]
            want_leaves, want_spec = tree_flatten(call.output)
            got_leaves, got_spec = tree_flatten(got)
            if want_spec != got_spec:
                return "rewritten region returns a different structure"
            for want, have in zip(want_leaves, got_leaves):
                if not isinstance(want, torch.Tensor):
                    continue
                if not isinstance(have, torch.Tensor) or have.shape != want.shape or have.dtype != want.dtype:
                    return "rewritten region changed an output's shape or dtype"
                if want.numel() == 0:
                    continue
                scale = float(want.float().abs().max()) or 1.0
                diff = float((have.float() - want.float()).abs().max()) / scale
                if not diff <= tolerance:
                    return f"outputs differ: relative max diff {diff:.2e} > {tolerance:.0e}"
    return None
