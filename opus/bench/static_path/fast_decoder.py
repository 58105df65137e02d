"""``FastDecoder``: an Opus ``DecoderLM`` rearranged for static shapes, built without modifying it.

Per layer: q/k/v fused into one linear, the MoE as the fuse stage's ``GroupedMoE`` (opus.fusion.moe,
its execution mode picked per call: ``experts=``), a dense MLP's gate/up fused; norms, RoPE,
embedding and lm_head are the model's own modules (shared, not copied). Projections and experts can
be quantized with opus.quant formats (``quant="fp8" | "w8a8" | "w4a16"``; experts one module per
expert, as the quantize stage leaves them); where a layer cannot take the format it stays in the
model dtype and ``notes`` says why.

``forward(ids, positions, cache, prefill=..., experts=...)`` returns last-position logits ``[B, V]``
and writes K/V for ``positions`` into a ``SlotKVBuffers``. ``prefill=True`` means the tokens start at
position 0: attention is causal over the new tokens only (flash/efficient kernels). Otherwise the
queries attend to every cache slot through a ``slot <= position`` mask; grouped-query heads are
folded into the query length (``[B, Hkv, G·T, D]``) so the cache is never expanded per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opus.bench.static_path.qlinear import (
    format_of,
    fuse_linears,
    group_size_for,
    module_bytes,
    quant_reason,
    quantize_linear,
)
from opus.fusion.linear_ops import StackedQuantLinear
from opus.fusion.moe import GroupedMoE, group_moe, grouped_moe
from opus.kv.cuda_graph import SlotKVBuffers
from opus.models.decoder import DecoderLM, SparseMoE, apply_rope
from opus.models.layout import DECODER
from opus.quant.formats import FORMATS


class FusedMLP(nn.Module):
    """SwiGLU with gate and up in one linear."""

    def __init__(self, mlp: nn.Module, quant: str | None, notes: list[str], name: str) -> None:
        super().__init__()
        self.inter = mlp.gate_proj.out_features
        self.gate_up, why = quantize_linear(fuse_linears([mlp.gate_proj, mlp.up_proj]), quant)
        self.down, why_d = quantize_linear(mlp.down_proj, quant)
        notes.extend(f"{name}: kept in float: {w}" for w in dict.fromkeys((why, why_d)) if w)

    def forward(self, x: torch.Tensor, mode: str = "dense") -> torch.Tensor:
        h = self.gate_up(x)
        return self.down(F.silu(h[..., : self.inter]) * h[..., self.inter :])


class FastLayer(nn.Module):
    def __init__(self, layer: nn.Module, quant: str | None, quant_experts: bool, notes: list[str], i: int) -> None:
        super().__init__()
        attn = layer.self_attn
        _require_float(f"layer {i}", {n: getattr(attn, n) for n in (*DECODER.qkv, DECODER.o_proj)})
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.qkv, why = quantize_linear(fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj]), quant)
        self.o_proj, why_o = quantize_linear(attn.o_proj, quant)
        notes.extend(f"layer {i} attention: kept in float: {w}" for w in dict.fromkeys((why, why_o)) if w)
        if isinstance(layer.mlp, SparseMoE):
            self.mlp: nn.Module = _grouped(layer.mlp, quant if quant_experts else None, f"layer {i}", notes)
        else:
            _require_float(f"layer {i} mlp", {n: getattr(layer.mlp, n, None) for n in DECODER.swiglu})
            self.mlp = FusedMLP(layer.mlp, quant, notes, f"layer {i} mlp")


def _grouped(moe: SparseMoE, quant: str | None, where: str, notes: list[str]) -> GroupedMoE:
    """The fuse stage's grouped MoE of ``moe`` (built from it, never modifying it), its experts quantized
    per expert with ``quant`` where the format takes them."""
    for e, expert in enumerate(moe.experts):
        _require_float(f"{where} expert {e}", {n: getattr(expert, n, None) for n in DECODER.swiglu})
    if quant is not None:
        parts = [(fuse_linears([x.gate_proj, x.up_proj]), x.down_proj) for x in moe.experts]
        why = quant_reason(quant, parts[0][0]) or quant_reason(quant, parts[0][1])
        if why is None:
            fmt = FORMATS[quant]
            with torch.no_grad():
                gate_up, down = (StackedQuantLinear([fmt.build(m, group_size_for(m.in_features)).requires_grad_(False)
                                                     for m in mods]) for mods in zip(*parts))
            built = grouped_moe(moe, gate_up, down)
            if isinstance(built, GroupedMoE):
                return built
            why = built
        notes.append(f"{where}: experts kept in {str(moe.gate.weight.dtype).removeprefix('torch.')}: {why}")
    built = group_moe(moe)
    if isinstance(built, str):
        raise TypeError(f"{where}: the MoE cannot be grouped: {built}")
    return built


def _require_float(where: str, linears: dict[str, object]) -> None:
    """FastDecoder rearranges float ``nn.Linear`` weights; quantized/fused models are rejected by name."""
    for name, module in linears.items():
        if type(module) is not nn.Linear:
            raise TypeError(f"{where}.{name} is {type(module).__name__}, not nn.Linear: FastDecoder takes the "
                            "float model (quantize with FastDecoder(model, quant=...) instead)")


class FastDecoder(nn.Module):
    def __init__(self, model: DecoderLM, quant: str | None = None, quant_experts: bool = True) -> None:
        super().__init__()
        cfg = model.config
        unlike = [name for name, differs in (("sandwich norms", cfg.sandwich_norms), ("(1 + w) norms", cfg.norm_offset),
                                             ("scaled embeddings", cfg.embed_scale),
                                             ("another softmax scale", cfg.attn_scale is not None),
                                             ("local RoPE base", cfg.rope_local_theta is not None),
                                             (f"{cfg.hidden_act} MLP", cfg.hidden_act != "silu")) if differs]
        if unlike:  # its layers are Llama-shaped: a model that is not would run wrong, not slow
            raise ValueError(f"FastDecoder does not run {cfg.family} ({', '.join(unlike)})")
        self.config = cfg
        self.quant = quant
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.splits = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        self.notes: list[str] = []
        self.embed_tokens, self.norm = model.model.embed_tokens, model.model.norm
        self.rotary_emb, self.lm_head = model.model.rotary_emb, model.lm_head
        self.layers = nn.ModuleList(FastLayer(layer, quant, quant_experts, self.notes, i)
                                    for i, layer in enumerate(model.model.layers))
        weight = model.lm_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        moes = [la.mlp for la in self.layers if isinstance(la.mlp, GroupedMoE)]
        # Why the capturable grouped mode cannot run the experts here (device, dtype or quantized experts).
        self.grouped_reason = next((r for m in moes if (r := m.mode_reason("grouped"))), None)
        if self.grouped_reason and moes:
            self.notes.append(f"prefill experts run sorted (not captured): {self.grouped_reason}")

    @property
    def has_moe(self) -> bool:
        return any(isinstance(layer.mlp, GroupedMoE) for layer in self.layers)

    def new_cache(self, batch_size: int, max_seq_len: int) -> SlotKVBuffers:
        return SlotKVBuffers.for_config(self.config, batch_size, max_seq_len, self.device, self.dtype)

    def prefill_mode(self) -> str:
        return "sorted" if self.grouped_reason else "grouped"

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: SlotKVBuffers, prefill: bool,
                experts: str = "dense") -> torch.Tensor:
        h = self.embed_tokens(ids)
        cos, sin = self.rotary_emb(positions, h.dtype)
        mask = None if prefill else cache.mask(positions)
        for i, layer in enumerate(self.layers):
            h = h + self._attention(i, layer, layer.input_layernorm(h), cos, sin, positions, cache, mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h), experts)
        return self.lm_head(self.norm(h[:, -1]))

    def _attention(self, i: int, layer: FastLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, cache: SlotKVBuffers, mask: torch.Tensor | None) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = layer.qkv(x).split(self.splits, dim=-1)
        q, k, v = q.view(b, t, heads, d), k.view(b, t, kv_heads, d), v.view(b, t, kv_heads, d)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(i, k, v, positions)
        if mask is None:  # prefill from position 0: causal among the new tokens, nothing cached before
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
        else:
            group = heads // kv_heads
            k_all, v_all = cache.layer(i)
            qg = q.reshape(b, kv_heads, group * t, d)  # query head h uses KV head h // group
            out = F.scaled_dot_product_attention(qg, k_all, v_all, attn_mask=mask.repeat(group, 1))
            out = out.view(b, heads, t, d)
        return layer.o_proj(out.transpose(1, 2).reshape(b, t, heads * d))

    @torch.no_grad()
    def prefill_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Last-position logits of ``ids`` ([B, T]) through a fresh cache (a parity check, not a fast path)."""
        cache = self.new_cache(ids.shape[0], ids.shape[1])
        positions = torch.arange(ids.shape[1], device=self.device)
        return self(ids.to(self.device), positions, cache, prefill=True, experts=self.prefill_mode())

    def summary(self) -> dict[str, object]:
        """Formats in use and the bytes of the tensors this decoder adds to the model's."""
        first = self.layers[0]
        formats = {"attention": format_of(first.qkv)}
        if isinstance(first.mlp, GroupedMoE):
            gate_up = first.mlp.experts.gate_up
            formats["experts"] = (gate_up.fmt if isinstance(gate_up, StackedQuantLinear)
                                  else str(gate_up.weight.dtype).removeprefix("torch."))
        own = sum(module_bytes(layer.qkv) + module_bytes(layer.o_proj) + _mlp_bytes(layer.mlp) for layer in self.layers)
        return {"formats": formats, "own_bytes": own, "notes": list(self.notes)}


def _mlp_bytes(mlp: nn.Module) -> int:
    """The experts are this decoder's own tensors; router and shared expert are the model's."""
    return module_bytes(mlp.experts) if isinstance(mlp, GroupedMoE) else module_bytes(mlp)
