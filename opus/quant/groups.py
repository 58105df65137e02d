"""Quantization groups: layers that must share a format (q/k/v; the experts of one layer)."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from torch import nn

EXPERT = re.compile(r"^(?P<layer>.*\.mlp)\.experts\.\d+\.(?P<proj>\w+)$")
QKV = re.compile(r"^(?P<attn>.*\.self_attn)\.[qkv]_proj$")
GATE_UP = re.compile(r"^(?P<mlp>.*\.(mlp|shared_expert))\.(gate|up)_proj$")


@dataclass
class QGroup:
    name: str
    modules: list[str] = field(default_factory=list)
    role: str = "other"


def role_of(name: str) -> str:
    if ".experts." in name or ".shared_expert." in name:
        return "experts"
    if name.endswith("mlp.gate") or name.endswith("shared_expert_gate"):
        return "router"
    if ".self_attn." in name:
        return "attention"
    if "lm_head" in name:
        return "lm_head"
    if ".mlp." in name:
        return "mlp"
    return "other"


def _group_name(name: str) -> str:
    if match := EXPERT.match(name):
        proj = "gate_up" if match["proj"] in ("gate_proj", "up_proj") else match["proj"]
        return f"{match['layer']}.experts.{proj}"
    if match := QKV.match(name):
        return f"{match['attn']}.qkv"
    if match := GATE_UP.match(name):  # a dense or shared-expert SwiGLU: gate and up read one input
        return f"{match['mlp']}.gate_up"
    return name


def matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def tied_to_embedding(model: nn.Module, name: str) -> bool:
    weight = model.get_submodule(name).weight
    return any(isinstance(m, nn.Embedding) and m.weight is weight for m in model.modules())


def build_groups(model: nn.Module, include: list[str], exclude: list[str], *,
                 tied: bool = False) -> list[QGroup]:
    """All nn.Linear layers selected by the globs, grouped.

    A linear tied to the embedding (a tied lm_head) is a group only with ``tied``: quantizing it gives
    the head its own packed copy while the embedding keeps the float table (the lookup needs it), so it
    costs memory instead of saving it — a trade for the planner, not for a uniform format.
    """
    groups: dict[str, QGroup] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if (include and not matches(name, include)) or matches(name, exclude):
            continue
        if not tied and tied_to_embedding(model, name):
            continue
        key = _group_name(name)
        groups.setdefault(key, QGroup(key, role=role_of(name))).modules.append(name)
    return list(groups.values())


# Routers decide which expert runs: quantizing them moves tokens, not just values.
ROUTER_PATTERNS = ["*.mlp.gate", "*shared_expert_gate"]


def uniform_assignment(model: nn.Module, fmt: str, group_size: int = 128,
                       exclude: list[str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """Every decoder linear in one format (routers and tied lm_heads stay float).

    Returns ``(assignment, skipped)``: layers whose shape the format's kernel cannot take are left
    out of the assignment and listed in ``skipped`` with the reason.
    """
    from opus.quant.formats import FORMATS

    assignment: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for group in build_groups(model, [], ROUTER_PATTERNS if exclude is None else exclude):
        for name in group.modules:
            reason = FORMATS[fmt].unsupported(model.get_submodule(name), group_size)
            if reason:
                skipped[name] = reason
            else:
                assignment[name] = fmt
    return assignment, skipped
