"""SmoothQuant: migrate activation outliers into the weights, exactly, before int8 quantization.

For a group of linears that read one activation X, with a per-channel factor s:
``X W^T = (X / s)(W * s)^T``. The division is folded into whatever produced X — the preceding
RMSNorm weight, the rows of ``up_proj`` (for ``down_proj``: the SwiGLU product is linear in up),
or the rows of ``v_proj`` (for ``o_proj``: attention output is linear in V; with grouped-query
attention the factor is shared by the query heads of a group). The migration strength α is chosen
per group from a grid by the error of int8 per-token × int8 per-channel products on calibration rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from opus.models.layout import DECODER
from opus.quant.calibrate import ActivationStats
from opus.quant.kernels import fake_int8_activation, fake_int8_weight

ALPHA_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass
class SmoothGroup:
    source: str  # the module that produces the activation: a norm, up_proj or v_proj
    kind: str  # "norm" | "rows" | "v_to_o"
    targets: list[str]


def smooth_groups(model: nn.Module) -> list[SmoothGroup]:
    """Groups for Opus's decoder models; other modules get none (W8A8 then runs unsmoothed).

    Paths come from the layout table: per layer, the input norm feeds q/k/v, v feeds o, each SwiGLU's
    up feeds its down, and the post-attention norm feeds every reader of the MLP input (the router,
    the shared-expert gate, every expert's gate/up) — with sandwich norms (gemma3) the pre-feed-forward
    norm does (``DECODER.mlp_norm``), and a (1 + w) norm takes the factor as (1 + w) / s - 1.
    """
    d = DECODER
    try:
        layers = model.get_submodule(d.layers)
    except AttributeError:
        return []
    groups: list[SmoothGroup] = []
    for i, layer in enumerate(layers):
        attn, mlp_name = d.attention_of(i), d.mlp_of(i)
        groups.append(SmoothGroup(f"{d.layer(i)}.{d.input_norm}", "norm", [f"{attn}.{n}" for n in d.qkv]))
        groups.append(SmoothGroup(f"{attn}.{d.v_proj}", "v_to_o", [f"{attn}.{d.o_proj}"]))
        mlp = getattr(layer, d.mlp)
        swiglus = [f"{mlp_name}.{d.experts}.{e}" for e in range(len(getattr(mlp, d.experts, [])))]
        if getattr(mlp, d.shared_expert, None) is not None:
            swiglus.append(f"{mlp_name}.{d.shared_expert}")
        if not swiglus:
            swiglus = [mlp_name]
        readers = [f"{mlp_name}.{d.router}"] if hasattr(mlp, d.experts) else []
        if getattr(mlp, d.shared_expert_gate, None) is not None:
            readers.append(f"{mlp_name}.{d.shared_expert_gate}")
        for prefix in swiglus:
            readers += [f"{prefix}.{n}" for n in d.gate_up]
            groups.append(SmoothGroup(f"{prefix}.{d.up_proj}", "rows", [f"{prefix}.{d.down_proj}"]))
        groups.append(SmoothGroup(f"{d.layer(i)}.{d.mlp_norm(layer)}", "norm", readers))
    return groups


def _factors(act_max: torch.Tensor, weight_max: torch.Tensor, alpha: float) -> torch.Tensor:
    s = act_max.clamp(min=1e-5).pow(alpha) / weight_max.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(1e-4, 1e4)


def _error(samples: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor) -> float:
    x = samples / s
    total = 0.0
    for w in weights:
        ref = samples @ w.t()
        out = fake_int8_activation(x) @ fake_int8_weight(w * s).t()
        total += float((out - ref).pow(2).sum() / ref.pow(2).sum().clamp(min=1e-12))
    return total


def _group_channels(model: nn.Module, group: SmoothGroup) -> tuple[int, int]:
    attn = model.get_submodule(group.source.rsplit(".", 1)[0])
    return attn.num_heads // attn.num_kv_heads, attn.head_dim


def _reduce_heads(values: torch.Tensor, rep: int, head_dim: int) -> torch.Tensor:
    """o_proj input channels (q heads) -> v_proj output channels (kv heads): max over each group."""
    return values.reshape(-1, rep, head_dim).amax(dim=1).reshape(-1)


def _expand_heads(values: torch.Tensor, rep: int, head_dim: int) -> torch.Tensor:
    return values.reshape(-1, 1, head_dim).expand(-1, rep, head_dim).reshape(-1)


@dataclass
class Factors:
    """One group's chosen migration: its readers' inputs are divided by ``s``, their weights multiplied."""

    group: SmoothGroup
    s: torch.Tensor  # over the readers' input channels
    alpha: float
    rep: int
    head_dim: int


@torch.no_grad()
def choose_factors(model: nn.Module, stats: ActivationStats, groups: list[SmoothGroup],
                   alpha: float | None = None) -> list[Factors]:
    """Each group's factors (α from the grid by the int8 product error), the model left as it is."""
    chosen: list[Factors] = []
    for group in groups:
        # Every reader of the activation is rescaled (a norm feeds all experts, routed or not);
        # statistics come from the readers that saw tokens during calibration.
        measured = [t for t in group.targets if t in stats.absmax]
        if not measured:
            continue
        weights = [model.get_submodule(t).weight.float() for t in group.targets]
        act = torch.stack([stats.absmax[t] for t in measured]).amax(dim=0)
        w_max = torch.cat(weights).abs().amax(dim=0)
        samples = stats.samples.get(measured[0])
        rep, head_dim = _group_channels(model, group) if group.kind == "v_to_o" else (1, 0)
        best_alpha, best_s, best_err = None, None, float("inf")
        for a in (alpha,) if alpha is not None else ALPHA_GRID:
            s = _factors(act, w_max, a)
            if group.kind == "v_to_o" and rep > 1:  # one factor per kv channel, shared by its q heads
                s = _expand_heads(_reduce_heads(s, rep, head_dim), rep, head_dim)
            err = _error(samples, weights, s) if samples is not None and alpha is None else 0.0
            if err < best_err:
                best_alpha, best_s, best_err = a, s, err
        chosen.append(Factors(group, best_s, best_alpha, rep, head_dim))
    return chosen


def input_scales(factors: list[Factors]) -> dict[str, torch.Tensor]:
    """``{linear: s}``: what folding ``factors`` divides each reader's input by."""
    return {t: f.s for f in factors for t in f.group.targets}


@torch.no_grad()
def fold_factors(model: nn.Module, factors: list[Factors]) -> dict[str, float]:
    """Fold chosen factors into the model in place; returns the α per group (keyed by source)."""
    for f in factors:
        _fold(model, f.group, f.group.targets, f.s, f.rep, f.head_dim)
    return {f.group.source: f.alpha for f in factors}


def apply_smoothing(model: nn.Module, stats: ActivationStats, groups: list[SmoothGroup],
                    alpha: float | None = None) -> dict[str, float]:
    """Fold factors into the model in place; returns the α chosen per group (keyed by source)."""
    return fold_factors(model, choose_factors(model, stats, groups, alpha))


def _fold(model: nn.Module, group: SmoothGroup, targets: list[str], s: torch.Tensor, rep: int,
          head_dim: int) -> None:
    for name in targets:
        weight = model.get_submodule(name).weight
        weight.mul_(s.to(weight.dtype)[None, :])
    source = model.get_submodule(group.source)
    if group.kind == "v_to_o" and rep > 1:
        s = _reduce_heads(s, rep, head_dim)
    if group.kind == "norm" and getattr(source, "offset", False):  # scales by 1 + weight (gemma3)
        source.weight.copy_(((1.0 + source.weight.float()) / s - 1.0).to(source.weight.dtype))
    elif group.kind == "norm":
        source.weight.div_(s.to(source.weight.dtype))
    else:  # rows of up_proj / v_proj produce the channels that are divided by s
        source.weight.div_(s.to(source.weight.dtype)[:, None])
        if source.bias is not None:
            source.bias.div_(s.to(source.bias.dtype))
