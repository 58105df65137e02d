"""How close a contender's batch-1 decode comes to the memory-bandwidth bound.

At batch 1 a decoder reads every weight it uses once per token, and little else: its decode speed can
not exceed the machine's memory bandwidth divided by those bytes. The bandwidth is measured here, before
any contender is built, as STREAM's copy measures it (bytes read plus bytes written over the fastest of
a few copies of a buffer far larger than the caches, on the bench's threads). The bytes a token reads
are the contender's model bytes as stored (``model_mb``: its tensors, ONNX graph or GGUF file) times the
fraction of the model a token uses, from the fp32 model: a mixture of experts reads ``top_k`` of its
``num_experts`` experts, and an input embedding that is not tied to the output head is read one row at a
time. The KV cache (a few MB at these lengths) is left out, so the share is a slight overestimate.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

MB = 2**20


def copy_bandwidth_gb_s(size_mb: int = 512, repeats: int = 5) -> float:
    """STREAM-copy bandwidth in GB/s (10^9 bytes): (read + written bytes) / the fastest copy's time."""
    src = torch.ones(size_mb * MB // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best / 1e9


def read_fraction(model: nn.Module) -> float:
    """The share of the model's parameter bytes one decoded token reads."""
    config = getattr(model, "config", None)
    experts, top_k = int(getattr(config, "num_experts", 0) or 0), int(getattr(config, "top_k", 0) or 0)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    total = read = 0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        total += size
        if ".experts." in name and experts > 0 and top_k > 0:
            read += size * min(top_k, experts) / experts
        elif "embed_tokens" in name and not tied:
            continue  # one row per token
        else:
            read += size
    return read / total if total else 1.0


def bound_figures(metrics: dict[str, Any], bandwidth_gb_s: float, fraction: float) -> dict[str, float]:
    """``bytes_per_token_mb``, ``bound_tok_s`` and ``decode_bound_share`` of a row, where it has the figures."""
    model_mb, decode = metrics.get("model_mb"), metrics.get("decode_tok_s")
    if not (isinstance(model_mb, (int, float)) and model_mb > 0 and bandwidth_gb_s > 0):
        return {}
    per_token_mb = model_mb * fraction
    bound = bandwidth_gb_s * 1e9 / (per_token_mb * MB)
    out = {"bytes_per_token_mb": per_token_mb, "bound_tok_s": bound}
    if isinstance(decode, (int, float)) and decode > 0:
        out["decode_bound_share"] = decode / bound
    return out
