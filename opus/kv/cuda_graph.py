"""Static KV caches for CUDA graphs: cache kind ``"cuda_graph"``, and the slot buffers of opus.fusion's FastDecoder.

    {"kind": "cuda_graph", "provider": "opus.kv.cuda_graph", "capture": true, "slot_multiple": 128}

``CudaGraphKVCache`` is the static cache of opus.kv.static (same buffers, eager prefill through
``update``, decode steps through ``decode_step`` with a position tensor and a slot mask) whose decode
step, instead of being compiled, is captured once per cache in a ``torch.cuda.CUDAGraph`` and then
replayed: each later step is one ``replay()`` with no Python or dispatch work at all. With
``capture: false``, or off CUDA, the very same step runs uncaptured (how CPU CI exercises it). A step
that cannot be captured (an op that syncs with the host, such as a data-dependent MoE gather) runs
uncaptured from then on and says why in ``opus.kv.compiled_steps.NOTES``.

``SlotKVBuffers`` is what opus.bench.static_path.runner's CUDA-graph runner writes: one buffer per K and V.
Shapes never change, so a decode step that writes position ``p`` and attends to every slot with a
``key_pos <= p`` mask has the same shapes at every step and can be captured in a CUDA graph. Slots
past the current position hold stale values; the mask hides them, and each is overwritten before
any query can see it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from opus.kv import compiled_steps, static
from opus.kv.cache import CacheShape, KVCache, register_kind
from opus.models.config import ModelConfig

KIND = "cuda_graph"
PROVIDER = "opus.kv.cuda_graph"


class SlotKVBuffers:
    """K and V for every layer: ``[layers, batch, kv_heads, max_seq_len, head_dim]`` each."""

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        shape = (num_layers, batch_size, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        # Key positions 0..S-1: a decode mask is ``key_pos <= query position``.
        self.key_pos = torch.arange(max_seq_len, device=device)

    @classmethod
    def for_config(cls, cfg: ModelConfig, batch_size: int, max_seq_len: int, device: torch.device | str,
                   dtype: torch.dtype) -> SlotKVBuffers:
        return cls(cfg.num_layers, batch_size, cfg.num_kv_heads, max_seq_len, cfg.head_dim, device, dtype)

    @property
    def batch_size(self) -> int:
        return int(self.k.shape[1])

    @property
    def max_seq_len(self) -> int:
        return int(self.k.shape[3])

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store ``k, v`` ([B, H, T, D]) of ``layer`` at ``positions`` ([T] long, on the cache's device)."""
        self.k[layer].index_copy_(2, positions, k)
        self.v[layer].index_copy_(2, positions, v)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot of ``layer`` ([B, H, S, D] views); mask the ones past the query's position."""
        return self.k[layer], self.v[layer]

    def mask(self, positions: torch.Tensor) -> torch.Tensor:
        """``[T, S]`` boolean: query at ``positions[t]`` may see key slot ``s`` iff ``s <= positions[t]``."""
        return self.key_pos[None, :] <= positions[:, None]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class CudaGraphKVCache(static.CompiledStaticKVCache):
    """opus.kv.static's buffers and masked step; the decode step captured once in a CUDA graph."""

    def __init__(self, shape: CacheShape, capture: bool = True,
                 slot_multiple: int = static.DEFAULT_SLOT_MULTIPLE) -> None:
        super().__init__(shape, compile_decode=False, slot_multiple=slot_multiple)
        self.capture = capture and shape.device.type == "cuda"
        self._graph: torch.cuda.CUDAGraph | None = None
        self._tried = False
        self._ids = torch.zeros(shape.batch_size, 1, dtype=torch.long, device=shape.device)  # the graph's input
        self._out: torch.Tensor | None = None  # the graph's output: overwritten by every replay

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def _run_step(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        self._ids.copy_(input_ids)
        if self.capture and not self._tried:
            self._tried = True
            self._graph = self._capture(model)
        if self._graph is None:
            return static.eager_step(model)(self._ids, self.position, self.k, self.v, self.key_pos)
        self._graph.replay()
        assert self._out is not None
        return self._out

    def _capture(self, model: nn.Module) -> torch.cuda.CUDAGraph | None:
        """Warm the step up on a side stream, then capture it; None (and a note) if it cannot be captured.

        The warm-up writes the current slot twice with the values the real step writes, so no state
        needs restoring."""
        step, device = static.eager_step(model), self._ids.device
        args = (self._ids, self.position, self.k, self.v, self.key_pos)
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step(*args)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self._out = step(*args)
        except RuntimeError as exc:  # e.g. a host sync inside the step: keep going uncaptured, say so
            torch.cuda.synchronize(device)
            compiled_steps.NOTES.append(f"{type(model).__name__}: decode step not captured in a CUDA graph, "
                                        f"runs uncaptured: {str(exc).splitlines()[0][:200]}")
            self._out = None
            return None
        return graph


class _CudaGraphKind(static._StaticKind):
    name, provider, simplicity = KIND, PROVIDER, 3
    OPTIONS = ("capture", "slot_multiple")

    def build(self, options: dict[str, Any], shape: CacheShape) -> KVCache:
        self.check_options(options)
        return CudaGraphKVCache(shape, bool(options.get("capture", True)), static.slot_multiple_of(options))

    def describe(self, options: dict[str, Any]) -> str:
        return "static, CUDA-graph decode" if options.get("capture", True) else "static, uncaptured decode"

    def candidates(self, settings: dict[str, Any]) -> list[dict[str, Any]]:
        """On CUDA, the captured step. Elsewhere ``cuda_graph: true`` measures the same step uncaptured
        (CPU CI); by default the captured candidate is listed and reported unavailable, with why."""
        wanted = settings.get("cuda_graph")
        if wanted is False:
            return []
        on_cuda = torch.device(settings.get("device", "cpu")).type == "cuda"
        multiple = int(settings.get("static_slot_multiple", static.DEFAULT_SLOT_MULTIPLE))
        return [cache_config(on_cuda or wanted is not True, multiple)]

    def unavailable(self, model: nn.Module, options: dict[str, Any]) -> str | None:
        reason = static.decoder_reason(model)
        param = next(iter(model.parameters()), None)
        device = param.device if param is not None else torch.device("cpu")
        if reason is None and options.get("capture", True) and device.type != "cuda":
            reason = (f"CUDA graphs need a CUDA device; the model is on {device.type} "
                      "(cuda_graph: true measures the same step uncaptured)")
        return reason


CUDA_GRAPH = register_kind(_CudaGraphKind())


def cache_config(capture: bool = True, slot_multiple: int = static.DEFAULT_SLOT_MULTIPLE) -> dict[str, Any]:
    return CUDA_GRAPH.config(capture=capture, slot_multiple=slot_multiple)
