"""A tiny decoder and an engine around it, for in-process serving tests (token ids, no tokenizer)."""

from __future__ import annotations

import threading

import torch

from opus.models.config import ModelConfig
from opus.models.decoder import DecoderLM
from opus.runtime.engine import generate
from opus.serve.blocks import BlockManager
from opus.serve.kv_blocks import KVBlockPool, PoolShape
from opus.serve.scheduler import Engine, Request


def tiny_decoder(moe: bool = False, seed: int = 0) -> DecoderLM:
    """Grouped-query attention (4 query heads on 2 KV heads) as in K3; ``moe``: a Mixtral-style MoE."""
    torch.manual_seed(seed)
    cfg = ModelConfig(family="mixtral" if moe else "llama", vocab_size=96, hidden_size=32, intermediate_size=48,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256,
                      num_experts=4 if moe else 0, top_k=2 if moe else 0, moe_intermediate_size=24 if moe else 0)
    model = DecoderLM(cfg).eval()
    with torch.no_grad():  # a sharper distribution than the init's: greedy ties would make comparisons flaky
        model.lm_head.weight.mul_(8.0)
    return model


def make_engine(model: DecoderLM, *, max_batch: int = 4, num_blocks: int = 64, block_size: int = 4,
                max_waiting: int = 16, prefix_caching: bool = True, compile_decode: bool = False,
                prefill_chunk: int = 512, step_tokens: int = 512) -> Engine:
    cfg = model.config
    shape = PoolShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, block_size, torch.float32,
                      torch.device("cpu"))
    return Engine(model, KVBlockPool(shape), BlockManager(num_blocks, block_size, prefix_caching), max_batch=max_batch,
                  max_waiting=max_waiting, max_context=cfg.max_position_embeddings, prefill_chunk=prefill_chunk,
                  step_tokens=step_tokens,
                  compile_decode=compile_decode)


def reference(model: DecoderLM, prompt: list[int], new: int) -> list[int]:
    """Greedy tokens from Opus's plain engine (one request, growing cache)."""
    return generate(model, torch.tensor([prompt]), new).tokens[0].tolist()


class Collector:
    """Every request's tokens and finish reason, gathered from the engine thread."""

    def __init__(self, count: int) -> None:
        self.tokens: dict[int, list[int]] = {i: [] for i in range(count)}
        self.reasons: dict[int, str] = {}
        self.done = threading.Event()
        self._count = count
        self._lock = threading.Lock()

    def request(self, index: int, prompt: list[int], new: int, **kw: object) -> Request:
        def emit(token: int | None, reason: str | None) -> None:
            with self._lock:
                if token is not None:
                    self.tokens[index].append(token)
                if reason is not None:
                    self.reasons[index] = reason
                    if len(self.reasons) == self._count:
                        self.done.set()

        return Request(prompt, new, emit, **kw)  # type: ignore[arg-type]
