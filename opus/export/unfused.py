"""The optimized model laid out as its source checkpoint was: one entry per original linear, fused layers
split back, MoE experts unstacked, with each layer's planned format and the float weight it computes.

Exporters to other tools' formats (compressed-tensors, GGUF) start here. The fuse stage's merged
layers hold exactly the rows of the layers they replaced (``concat_quantized`` concatenates along the
output axis; ``GroupedMoE`` stacks the experts), so splitting them back is exact. SmoothQuant's
factors are folded into the preceding norms and the weights, which stay in the model's own layout.

``layers(model)`` -> {decoder name: ``Layer``}; ``other_tensors(model)`` -> every parameter or
buffer that is not a linear layer's (embeddings, norms), by decoder name; ``checkpoint_name(name,
family)`` -> the name the family's Hugging Face checkpoints use on disk (Mixtral's
``block_sparse_moe.experts.E.w1``), which is what transformers, vLLM and llama.cpp's converter read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from opus.models.layout import DECODER, family
from opus.quant.formats import FORMATS
from opus.quant.formats.registry import is_quantized, noop_name
from opus.quant.tied import SharedInt8Embedding


@dataclass
class Layer:
    """One original linear layer of the model, as the optimized model computes it."""

    name: str  # decoder name, e.g. model.layers.0.self_attn.q_proj
    fmt: str  # the registry format it runs in ("fp32" for a float layer)
    weight: torch.Tensor  # [out, in] float32: what the layer computes with (dequantized when quantized)
    bias: torch.Tensor | None
    module: nn.Module  # the module holding it (a fused or stacked one holds more rows than this layer)
    rows: tuple[int, int]  # this layer's output rows in ``module``
    group_size: int | None = None  # group-wise formats: the group along the input features


def _format_of(module: nn.Module) -> str:
    if is_quantized(module):
        return str(module.fmt)
    return noop_name()


def _float_weight(module: nn.Module) -> torch.Tensor:
    if is_quantized(module):
        return FORMATS[_format_of(module)].dequantize(module).detach().float()
    return module.weight.detach().float()


def _split(name: str, module: nn.Module, parts: list[tuple[str, int]]) -> list[Layer]:
    """The layers ``module`` concatenates along its output rows, as (suffix, rows) in order."""
    weight, bias = _float_weight(module), getattr(module, "bias", None)
    if sum(n for _, n in parts) != weight.shape[0]:
        raise ValueError(f"{name}: {weight.shape[0]} output rows, expected {sum(n for _, n in parts)}")
    out, start = [], 0
    fmt, group = _format_of(module), getattr(module, "group_size", None)
    for suffix, n in parts:
        b = bias.detach().float()[start:start + n] if bias is not None else None
        out.append(Layer(f"{name}{suffix}", fmt, weight[start:start + n], b, module, (start, start + n), group))
        start += n
    return out


def _attention_parts(model: nn.Module) -> list[tuple[str, int]]:
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [(DECODER.q_proj, q), (DECODER.k_proj, kv), (DECODER.v_proj, kv)]


def _experts(prefix: str, grouped: nn.Module) -> list[Layer]:
    """A ``GroupedExperts``'s stacked gate_up and down, back to one gate/up/down per expert."""
    out: list[Layer] = []
    pairs = ((grouped.gate_up, (DECODER.gate_proj, DECODER.up_proj)), (grouped.down, (DECODER.down_proj,)))
    for stacked, parts in pairs:
        experts = getattr(stacked, "experts", None)
        for e in range(stacked.num_experts):
            if experts is not None:  # quantized experts: one module per expert
                module = experts[e]
            else:  # float experts: one [E, out, in] weight
                module = nn.Linear(stacked.weight.shape[2], stacked.weight.shape[1], bias=stacked.bias is not None)
                module.weight = nn.Parameter(stacked.weight[e].detach(), requires_grad=False)
                if stacked.bias is not None:
                    module.bias = nn.Parameter(stacked.bias[e].detach(), requires_grad=False)
            rows = module.out_features // len(parts)
            out += _split(f"{prefix}.{e}.", module, [(p, rows) for p in parts])
    return out


def _sources(model: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """(name, kind, module) of every module holding original linear layers: ``experts`` (a grouped
    MoE's), ``qkv`` and ``gate_up`` (fused), ``linear`` (one layer, float or quantized)."""
    from opus.fusion.moe import GroupedExperts

    found: list[tuple[str, str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(f + ".") for f, _, _ in found):
            continue
        leaf = name.rpartition(".")[2]
        if isinstance(module, GroupedExperts):
            found.append((name, "experts", module))
        elif leaf == f"{DECODER.qkv_group}_proj":
            found.append((name, "qkv", module))
        elif leaf == f"{DECODER.gate_up_group}_proj":
            found.append((name, "gate_up", module))
        elif isinstance(module, nn.Linear) or is_quantized(module):
            found.append((name, "linear", module))
    return found


def layers(model: nn.Module) -> dict[str, Layer]:
    """Every original linear layer of ``model`` (fused or not) by its decoder name."""
    found: list[Layer] = []
    for name, kind, module in _sources(model):
        prefix = name.rpartition(".")[0] + "."
        if kind == "experts":
            found += _experts(name, module)
        elif kind == "qkv":
            found += _split(prefix, module, _attention_parts(model))
        elif kind == "gate_up":
            half = module.out_features // 2
            found += _split(prefix, module, [(DECODER.gate_proj, half), (DECODER.up_proj, half)])
        else:
            found += _split(name, module, [("", module.out_features)])
    return {layer.name: layer for layer in found}


def other_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers outside the linear layers (embeddings, norms), by decoder name."""
    consumed = [name for name, _, _ in _sources(model)]
    out = {name: tensor.detach() for name, tensor in model.state_dict().items()
           if not any(name.startswith(c + ".") for c in consumed)}
    for name, module in model.named_modules():
        if isinstance(module, SharedInt8Embedding):  # its table is the int8 lm_head's rows: written as floats
            out[f"{name}.weight"] = module.dequantized().detach()
    return out


_MIXTRAL_EXPERT = {DECODER.gate_proj: "w1", DECODER.up_proj: "w3", DECODER.down_proj: "w2"}


def checkpoint_name(name: str, family_name: str) -> str:
    """A decoder name as the family's Hugging Face checkpoints spell it on disk."""
    if family(family_name).moe == "mixtral":
        m = re.match(rf"(.*)\.{DECODER.mlp}\.({DECODER.experts}\.\d+)\.(\w+)(.*)$", name)
        if m and m[3] in _MIXTRAL_EXPERT:
            return f"{m[1]}.block_sparse_moe.{m[2]}.{_MIXTRAL_EXPERT[m[3]]}{m[4]}"
        return re.sub(rf"\.{DECODER.mlp}\.{DECODER.router}(?=\.|$)", f".block_sparse_moe.{DECODER.router}", name)
    return name
