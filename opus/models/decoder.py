"""One readable decoder-only LM for every supported family (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen-MoE,
Gemma 3).

Module names follow Hugging Face (``model.layers.N.self_attn.q_proj``, ``model.layers.N.mlp.gate``,
``model.layers.N.mlp.experts.E.gate_proj`` ...), so a layer name a user knows from HF means the same
here; ``opus.models.layout.DECODER`` lists them for every other module (tests/models/test_layout.py
checks the two agree). Every linear layer is a plain ``nn.Linear`` — each expert's gate/up/down and
the router included — because quantization swaps ``nn.Linear`` modules by name and fusion matches patterns.

Interface used by the engine::

    logits = model(input_ids, cache=None, start_pos=0, last_only=False)   # [B, T or 1, vocab]

With a cache, attention in layer i calls ``k_all, v_all = cache.update(i, k, v)`` (k, v after RoPE,
``[B, num_kv_heads, T, head_dim]``) and attends to everything the cache returns — masked by the
cache's ``mask`` where it is not None. A cache whose ``decodes_itself`` is True (opus.kv.static,
opus.kv.cuda_graph) runs one-token steps itself: it calls the model back with a view that carries the
``positions`` as a tensor, so a compiled or captured step never specializes on the position. Every
cache declares these hooks (opus.kv.cache.KVCache; ``CacheBase`` gives the defaults), so none is
probed here.

fx status (torch 2.13, tested in tests/models/test_fx.py): ``torch.fx.symbolic_trace`` succeeds on
the whole model with ``concrete_args={"cache": None, "start_pos": 0, "last_only": False}`` (or
``last_only=True``), on any decoder layer's attention and MLP / MoE block alone, and the traced
graph reproduces the eager logits. Forward has no Python control flow on tensor values: the MoE
loops over its experts in a static Python range and gathers tokens with index ops. The cache
update and the masked attention are ``torch.fx.wrap`` leaves, so a trace can also keep ``cache`` as
an input (the cache is a plain Python object, not a module; opus.fusion relies on this).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opus.errors import EXIT_INVALID, OpusError
from opus.models import int8_kv
from opus.models.attention import BLOCKED_BF16, DOT, INT8_STORED, blocked_attention, narrow_kv_attention
from opus.models.config import ModelConfig


class BeyondSlidingWindow(OpusError):
    """Attention would see more keys than the model's sliding window (Opus attends to the whole context)."""

    exit_code = EXIT_INVALID


class RMSNorm(nn.Module):
    """``offset`` (gemma3): the scale is ``1 + weight``, applied in fp32 before the cast back (Gemma3RMSNorm)."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and scale in the input dtype, exactly as transformers does.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE in the half-split ("NeoX") layout transformers uses.

    Frequencies are computed per call in fp32 rather than kept in a buffer: a buffer would be
    cast by ``model.to(torch.bfloat16)`` and silently blur positions, and a 128k-position cos/sin
    table would cost tens of MB. The cost is a few tiny ops per forward, not per layer — except in a
    compiled prompt: cos and sin read no buffer, so inductor recomputes them (pow, cos, sin) inside
    every kernel that applies them, for every head of every layer. There they come from one opaque op
    (``opus::rope_cos_sin``), computed once (K3 at batch 32 × 512, q and k: 5.7 against 2.8 ms a layer;
    the 135M shape at one 512-token prompt: 0.51 against 0.19 ms a layer; Intel Xeon, 2 threads). A
    compiled decode step (one position per row) and exports keep the inline ops.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                theta: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at ``positions``; ``theta`` another base (gemma3's local layers)."""
        base = self.theta if theta is None else theta
        # is_compiling first: under fx's symbolic trace the shape is a proxy, and a branch on it fails.
        if torch.compiler.is_compiling() and not torch.compiler.is_exporting() and positions.shape[-1] > 1:
            cos, sin = rope_cos_sin(positions, self.head_dim, float(base))
        else:
            cos, sin = _cos_sin(positions, self.head_dim, base)
        return cos.to(dtype), sin.to(dtype)


def _cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


_ROPE_TABLES: dict[tuple[int, float, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


@torch.library.custom_op("opus::rope_cos_sin", mutates_args=())
def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos, sin ``[*positions.shape, head_dim]``: RotaryEmbedding's, as one op a compiled graph keeps.

    Rows of a table kept per head size, base and device (positions 0 to the next power of two that covers
    them), so a compiled prefill gathers them instead of taking cos and sin of every position again
    (in K3's compiled 512-token prefill the op had taken up to 0.7 ms of about 14)."""
    if positions.numel() == 0 or positions.is_floating_point() or int(positions.min()) < 0:
        return _cos_sin(positions, head_dim, theta)
    key, needed = (head_dim, theta, positions.device), int(positions.max()) + 1
    table = _ROPE_TABLES.get(key)
    if table is None or table[0].shape[0] < needed:
        table = _ROPE_TABLES[key] = _cos_sin(torch.arange(1 << (needed - 1).bit_length(), device=positions.device),
                                             head_dim, theta)
    return table[0][positions], table[1][positions]


@rope_cos_sin.register_fake
def _(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*positions.shape, head_dim)
    return positions.new_empty(shape, dtype=torch.float32), positions.new_empty(shape, dtype=torch.float32)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


# fx leaves: the cache is a plain Python object and the mask depends on a Python flag and a shape,
# so attention traces (opus.fusion) with a cache only if these two steps are opaque calls.
@torch.fx.wrap
def cache_update(cache: object | None, layer: int, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if cache is None:
        return k, v
    return cache.update(layer, k, v)  # type: ignore[attr-defined]


@torch.fx.wrap
def cache_mask(cache: object | None) -> torch.Tensor | None:
    """The key mask a cache returns all of its slots with (a static cache's decode step), else None."""
    return None if cache is None else cache.mask  # type: ignore[attr-defined]


@torch.fx.wrap
def cache_attention(cache: object | None) -> str:
    """The attention kernel a cache asks for (``opus.models.attention.KERNELS``); ``"sdpa"`` without one."""
    return "sdpa" if cache is None else cache.attention  # type: ignore[attr-defined]


@torch.fx.wrap
def cache_scales(cache: object | None, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The per-slot scales of ``layer``'s int8 K and V when the cache hands attention its int8 bytes, else None."""
    return None if cache is None else cache.stored_scales(layer)  # type: ignore[attr-defined]


@torch.fx.wrap
def last_position(h: torch.Tensor, cache: object | None) -> torch.Tensor:
    """``h [B, T, H]`` at its last position, or where a padded prefill's view says the last real token is."""
    index = None if cache is None else cache.last_index  # type: ignore[attr-defined]
    return h[:, -1:, :] if index is None else h.index_select(1, index)


@torch.fx.wrap
def window_guard(k: torch.Tensor, window: int) -> torch.Tensor:
    """``k`` as it is, when attention sees no more keys than the sliding window; else an error.

    Within its window sliding-window attention is plain causal attention, so a Mistral runs exactly
    as long as every context fits; the caches, fused and exported decoders need no window mask. A
    static cache's keys are all its slots, so it must be sized within the window too.
    """
    if k.shape[2] > window:
        raise BeyondSlidingWindow(f"attention over {k.shape[2]} positions, beyond the model's sliding window of "
                                  f"{window}: Opus does not implement sliding-window attention; keep prompt plus new "
                                  f"tokens (and seq_len) within {window}")
    return k


@torch.fx.wrap
def scale_embedding(h: torch.Tensor, scale: float) -> torch.Tensor:
    """``h * scale`` with the scale rounded to ``h``'s dtype first, as Gemma3TextScaledWordEmbedding does
    (in bfloat16, sqrt(1152) is 34.0). An fx leaf: the dtype is known only when it runs."""
    return h * torch.tensor(scale, dtype=torch.float32, device=h.device).to(h.dtype)


@torch.fx.wrap
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, gqa: bool,
           mask: torch.Tensor | None = None, kernel: str = "sdpa",
           scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    # `causal` is True when nothing precedes the new tokens (no cache, or start_pos == 0).
    # Otherwise T new tokens attend causally among themselves and fully to the S - T cached ones;
    # a single decode token attends to everything, so it needs no mask — unless the cache returned
    # slots not written yet, and a mask (``[T, S]``, or ``[B, 1, T, S]`` per row; True = visible) with them.
    # `scales`: k and v are a cache's int8 bytes (kernel INT8_STORED), read by opus.models.int8_kv where it
    # takes the shape, else widened here.
    if scales is not None:
        if kernel == INT8_STORED and mask is not None and mask.dim() == 2 and int8_kv.unsupported(q, k) is None:
            return int8_kv.attention(q, k, scales[0], v, scales[1], mask)
        k, v = k.to(scales[0].dtype) * scales[0], v.to(scales[1].dtype) * scales[1]
    narrow = k.dtype != q.dtype  # a cache keeping K/V narrower (opus.kv.static kv_dtype)
    if (narrow or kernel == DOT) and mask is not None and mask.dim() == 2:
        return narrow_kv_attention(q, k, v, mask)
    if narrow:
        k, v = k.to(q.dtype), v.to(q.dtype)  # any other case: the stored values, widened
    if kernel in ("blocked", BLOCKED_BF16) and (out := blocked_attention(q, k, v, causal, mask,
                                                                         kernel == BLOCKED_BF16)) is not None:
        return out
    t, s = q.shape[2], k.shape[2]
    if mask is not None and gqa:
        # Query head h reads KV head h // group: fold each group into the query length so every
        # cache slot is read once, never expanded per head (compiled, enable_gqa copied the cache).
        b, heads, _, d = q.shape
        group = heads // k.shape[1]
        folded = mask.repeat(group, 1) if mask.dim() == 2 else mask.repeat(1, 1, group, 1)
        out = F.scaled_dot_product_attention(q.reshape(b, k.shape[1], group * t, d), k, v, attn_mask=folded)
        return out.view(b, heads, t, d)
    if mask is None and not causal and t > 1:
        rows = torch.arange(t, device=q.device)[:, None] + (s - t)
        mask = torch.arange(s, device=q.device)[None, :] <= rows
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, q_dim, kv_dim = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(h, q_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, kv_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, kv_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_dim, h, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        self.sliding_window = cfg.sliding_window if cfg.sliding_layers[layer_idx] else None
        # A softmax scale other than 1/sqrt(head_dim) (gemma3's query_pre_attn_scalar) scales q instead, so
        # every attention path (caches, fused, exported) stays plain scaled_dot_product_attention.
        scale = 1.0 if cfg.attn_scale is None else cfg.attn_scale * cfg.head_dim**0.5
        self.q_scale = None if scale == 1.0 else scale

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: object | None = None,
                causal: bool = True) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.q_scale is not None:
            q = q * self.q_scale
        k, v = cache_update(cache, self.layer_idx, k, v)
        if self.sliding_window is not None:
            k = window_guard(k, self.sliding_window)
        out = attend(q, k, v, causal, self.num_kv_heads != self.num_heads, cache_mask(cache), cache_attention(cache),
                     cache_scales(cache, self.layer_idx))
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). Also each MoE expert. ``act="gelu_tanh"``: GeGLU
    with tanh-approximated GELU (gemma3's gelu_pytorch_tanh)."""

    def __init__(self, hidden: int, inter: int, bias: bool = False, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.act == "gelu_tanh" else F.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


class SparseMoE(nn.Module):
    """Top-k softmax routing over SwiGLU experts, optional sigmoid-gated shared expert (qwen2_moe).

    ``dense = True`` runs every expert on every token and weights by the (mostly zero) routing
    matrix: more flops, but static shapes (for CUDA graphs / export). The default gathers only the
    routed tokens per expert, which is what a CPU wants.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.top_k, cfg.norm_topk_prob
        self.dense = False
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = MLP(cfg.hidden_size, shared) if shared else None
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        if self.dense:
            routing = torch.zeros_like(probs, dtype=x.dtype).scatter(1, chosen, weights)  # [N, E]
            for e, expert in enumerate(self.experts):
                out = out + routing[:, e : e + 1] * expert(x)
        else:
            for e, expert in enumerate(self.experts):
                hit = torch.where(chosen == e)  # (token index, slot); a token picks an expert once
                tokens, slots = hit[0], hit[1]
                y = expert(x[tokens]) * weights[tokens, slots].unsqueeze(-1)
                out = out.index_add(0, tokens, y)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp: nn.Module = (SparseMoE(cfg) if cfg.moe_layers[layer_idx]
                               else MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act))
        h, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset
        self.input_layernorm = RMSNorm(h, eps, offset)
        self.post_attention_layernorm = RMSNorm(h, eps, offset)
        # Sandwich norms (gemma3): post_attention_layernorm then normalises the attention output, and the
        # MLP has a norm on each side.
        self.pre_feedforward_layernorm = RMSNorm(h, eps, offset) if cfg.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(h, eps, offset) if cfg.sandwich_norms else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: object | None = None,
                causal: bool = True) -> torch.Tensor:
        if self.pre_feedforward_layernorm is not None and self.post_feedforward_layernorm is not None:
            h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, cache, causal))
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, causal)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    """The trunk; named ``model`` inside the LM so parameter names match Hugging Face's."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the lm_head when the config says so (call again after a reload)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, cache: object | None = None, start_pos: int = 0,
                last_only: bool = False) -> torch.Tensor:
        t = input_ids.shape[1]
        if cache is not None and cache.decodes_itself and t == 1 and start_pos > 0:  # type: ignore[attr-defined]
            # (cache first: fx traces cache=None.) A static cache runs decode steps itself, as one
            # compiled graph (opus.kv.static) or one captured CUDA graph (opus.kv.cuda_graph).
            return cache.decode_step(self, input_ids, start_pos)  # type: ignore[attr-defined]
        if cache is not None and cache.prefills_itself and start_pos == 0 and last_only:  # type: ignore[attr-defined]
            return cache.prefill_step(self, input_ids)  # type: ignore[attr-defined]
        h = self.model.embed_tokens(input_ids)
        if self.config.embed_scale:
            h = scale_embedding(h, self.config.hidden_size**0.5)
        # A compiled step's positions: a tensor, never an int (set only on a static cache's DecodeView).
        given = None if cache is None else cache.positions  # type: ignore[attr-defined]
        positions = given if given is not None else torch.arange(start_pos, start_pos + t, device=input_ids.device)
        cos, sin = self.model.rotary_emb(positions, h.dtype)
        local = self.config.rope_local_theta
        cos_local, sin_local = self.model.rotary_emb(positions, h.dtype, local) if local is not None else (cos, sin)
        if given is not None and given.dim() == 2:
            # Per-row positions ([B, T]: requests at different points of their text, opus.serve's continuous
            # batching): cos/sin [B, 1, T, D] broadcast over the heads of q/k [B, H, T, D].
            cos, sin, cos_local, sin_local = (c.unsqueeze(1) for c in (cos, sin, cos_local, sin_local))
        causal = cache is None or (given is None and start_pos == 0)
        for i, layer in enumerate(self.model.layers):
            if self.config.sliding_layers[i]:
                h = layer(h, cos_local, sin_local, cache, causal)
            else:
                h = layer(h, cos, sin, cache, causal)
        if last_only:  # the lm_head is the biggest GEMM of a prefill: skip unused positions
            h = last_position(h, cache)
        return self.lm_head(self.model.norm(h))
