"""Quantization groups: layers that must share a format (q/k/v; gate/up; the experts of one layer).

Which layers group together and the role each group gets come from ``opus.models.layout``, the same
table profiling reads, so a plan's group roles and profile.json's roles are one vocabulary.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from torch import nn

from opus.models.layout import ROUTER_PATTERNS, format_group, module_roles

__all__ = ["ROUTER_PATTERNS", "QGroup", "build_groups", "matches", "tied_to_embedding", "uniform_assignment"]


@dataclass
class QGroup:
    name: str
    modules: list[str] = field(default_factory=list)
    role: str = "other"


def matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def tied_to_embedding(model: nn.Module, name: str) -> bool:
    weight = model.get_submodule(name).weight
    return any(isinstance(m, nn.Embedding) and m.weight is weight for m in model.modules())


def build_groups(model: nn.Module, include: list[str], exclude: list[str], *,
                 tied: bool = False, whole_experts: bool = False) -> list[QGroup]:
    """All nn.Linear layers selected by the globs, grouped (``whole_experts``: opus.models.layout.format_group).

    A linear tied to the embedding (a tied lm_head) is a group only with ``tied``: quantizing it gives
    the head its own copy; only an int8-per-row copy also serves the lookup (``opus.quant.tied``, in the
    quantize stage), otherwise the embedding keeps the float table beside it and memory grows — a trade
    for the planner, not for a uniform format.
    """
    groups: dict[str, QGroup] = {}
    roles = module_roles(model)
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if (include and not matches(name, include)) or matches(name, exclude):
            continue
        if not tied and tied_to_embedding(model, name):
            continue
        key = format_group(name, whole_experts)
        groups.setdefault(key, QGroup(key, role=roles[name])).modules.append(name)
    return list(groups.values())


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
