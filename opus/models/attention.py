"""Attention kernels a cache can ask the decoder for (its ``attention``): ``"sdpa"``, ``"blocked"`` or
``"blocked_bf16"``.

``sdpa`` is torch's ``scaled_dot_product_attention`` as ``opus.models.decoder.attend`` calls it.
``blocked`` runs a causal prefill from position 0 in blocks of ``CAUSAL_BLOCK`` queries, each block
attending only to the keys up to its own end (a boolean mask on the diagonal block), each KV head's
query group folded into the query length as ``attend`` does (no key or value expanded per head).
torch's CPU flash kernel walks keys in splits of 512, so at a 512-token prompt its causal mask skips
no work; the blocks skip the upper triangle. Measured on K3's shapes (head_dim 32, 8 query heads on
2 KV heads; AMD EPYC AVX-512, torch 2.13, one layer, compiled): batch 32 × 512 46.7 vs 70.4 ms,
batch 1 × 512 1.9 vs 2.5 ms, but batch 2 × 2048 59 vs 41 ms, where torch's key splits do skip work.
Hence a choice the ``kv_config`` stage measures at the workload's shape, never a rule. In fp32 on the CPU the
blocks run as one C++ op (opus.models.native_attention: 1.24 against 2.17 ms for these torch ops at batch 1 ×
512, one layer); elsewhere, or where it did not build, as the torch ops below.

``blocked_bf16`` is the same op with its two products in bf16 (AVX-512 BF16 dot products over Q, K, V and the
softmax weights rounded to bfloat16; fp32 sums, softmax and output): 0.77 against 1.42 ms a layer on the shape
above. Lossy, so ``kv_config`` races it only within a perplexity limit (opus.runtime.kv_fidelity). Where it
cannot run (no AVX-512 BF16, a head size not a multiple of 32, not fp32 on the CPU) the fp32 blocks run.

Every other case (a decode step, a prompt of one block, a prefill after cached tokens) runs ``sdpa``:
the decode step's masked attention as two matmuls was 0.30 vs 0.71 ms alone at batch 32, yet the
whole compiled K3 step took the same 6.7 ms either way, so it is not here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opus.models import native_attention

BLOCKED_BF16 = "blocked_bf16"  # the blocked kernel's C++ op with bf16 products: lossy, raced only within a ppl limit
KERNELS = ("sdpa", "blocked", BLOCKED_BF16)
LOSSY_KERNELS = (BLOCKED_BF16,)
DOT = "dot"  # a decode step over narrower or int8 K/V (set by the cache's view, not a user's option)
INT8_STORED = "int8_stored"  # a decode step over int8 K/V as stored (opus.models.int8_kv; set by the cache's view)
CAUSAL_BLOCK = 64


def check_kernel(kernel: object) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"attention must be one of {', '.join(KERNELS)}, got {kernel!r}")
    return str(kernel)


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      mask: torch.Tensor | None, bf16: bool = False) -> torch.Tensor | None:
    """``attend``'s result by the blocked kernel, or None where it does not apply (``sdpa`` then). ``bf16``
    (kernel ``blocked_bf16``) runs the op's bf16 variant where ``bf16_reason`` allows, else the fp32 blocks:
    never less exact than asked."""
    if causal and mask is None and q.shape[2] == k.shape[2] and q.shape[2] > CAUSAL_BLOCK:
        if native_attention.reason(q, k, v) is None:
            bf16 = bf16 and native_attention.bf16_reason(q.dtype, q.device, q.shape[-1]) is None
            return native_attention.causal(q, k, v, bf16)
        return causal_blocks(q, k, v)
    return None


def narrow_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``q [B, H, T, D]`` over a cache's narrower (or int8-widened) ``k, v [B, KV, S, D]`` where ``mask
    [T, S]`` lets it see: two matmuls in the cache's dtype, the softmax in ``q``'s (the scores are widened first)."""
    b, heads, t, d = q.shape
    kv_heads, slots = k.shape[1], k.shape[2]
    group = heads // kv_heads
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    rows = q.reshape(b * kv_heads, group * t, d).to(k.dtype)
    scores = torch.bmm(rows, k.reshape(b * kv_heads, slots, d).transpose(1, 2)).to(q.dtype) * d**-0.5
    probs = torch.softmax(scores + bias.repeat(group, 1), dim=-1).to(v.dtype)
    return torch.bmm(probs, v.reshape(b * kv_heads, slots, d)).to(q.dtype).view(b, heads, t, d)


def causal_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int = CAUSAL_BLOCK) -> torch.Tensor:
    """Causal attention of ``q [B, H, T, D]`` over its own ``k, v [B, KV, T, D]``, ``block`` queries at a time."""
    b, heads, t, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    outs = []
    for start in range(0, t, block):
        end = min(t, start + block)
        rows = end - start
        visible = torch.ones(rows, end, dtype=torch.bool, device=q.device).tril(start).repeat(group, 1)
        folded = q[:, :, start:end].reshape(b, kv_heads, group * rows, d)
        out = F.scaled_dot_product_attention(folded, k[:, :, :end], v[:, :, :end], attn_mask=visible)
        outs.append(out.view(b, heads, rows, d))
    return torch.cat(outs, dim=2)
