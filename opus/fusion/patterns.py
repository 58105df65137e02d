"""fx rewrite patterns. Each finds its sites in a region's graph and rewrites one site at a time.

A site is named by the modules it involves (relative to its region), never by fx node names, so
the recipe can replay it on a fresh trace of the same structure.

Patterns, in the order they run:

- ``qkv`` / ``gate_up`` / ``linear_group``: linears reading the same input become one GEMM whose
  output is split (q/k/v, gate/up, any other group). Only one precision merges (``linear_ops``).
- ``silu_mul``: ``silu(gate) * up`` becomes one call (``swiglu`` on a fused gate/up output).
- ``add_rmsnorm``: a residual add feeding an RMSNorm becomes one call returning both.
- ``rmsnorm``: the 8-op eager RMSNorm becomes ``aten::rms_norm``, where that dispatches fewer ops.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from opus.fusion import ops
from opus.fusion.linear_ops import concat_linears, has_concat_rule
from opus.models.layout import DECODER


@dataclass
class Site:
    pattern: str
    region: str
    modules: tuple[str, ...]
    into: str = ""
    ops: tuple[str, ...] = ()
    reason: str = field(default="", compare=False)

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pattern": self.pattern, "region": self.region, "modules": list(self.modules)}
        if self.into:
            out["into"] = self.into
        return out

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> Site:
        return cls(rec["pattern"], rec["region"], tuple(rec["modules"]), rec.get("into", ""))

    def full_names(self) -> list[str]:
        return [f"{self.region}.{m}" if self.region else m for m in self.modules]


def _module(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    return gm.get_submodule(node.target) if node.op == "call_module" else None


def _is_linear(m: nn.Module | None) -> bool:
    return m is not None and (isinstance(m, nn.Linear) or has_concat_rule(m) or "Linear" in type(m).__name__)


def _find_module_node(gm: fx.GraphModule, target: str) -> fx.Node:
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target == target:
            return node
    raise LookupError(f"no call of module '{target}' in the traced graph")


# -- linear groups ----------------------------------------------------------------------------------
def _group_name(targets: list[str]) -> tuple[str, str]:
    prefix = targets[0].rpartition(".")[0]
    lasts = [t.rpartition(".")[2] for t in targets]
    # The fused linear's name (``qkv_proj``, ``gate_up_proj``) is recorded in recipes: never rename it.
    if lasts == list(DECODER.qkv):
        pattern, name = DECODER.qkv_group, f"{DECODER.qkv_group}_proj"
    elif lasts == list(DECODER.gate_up):
        pattern, name = DECODER.gate_up_group, f"{DECODER.gate_up_group}_proj"
    else:
        pattern, name = "linear_group", "__".join(lasts)
    return pattern, f"{prefix}.{name}" if prefix else name


def find_linear_groups(gm: fx.GraphModule, region: str) -> list[Site]:
    sites = []
    for node in gm.graph.nodes:
        users = [u for u in node.users if u.op == "call_module" and u.args == (node,) and not u.kwargs
                 and _is_linear(_module(gm, u))]
        targets = [u.target for u in users]
        if len(targets) < 2 or len({t.rpartition(".")[0] for t in targets}) != 1:
            continue
        pattern, into = _group_name(targets)
        sites.append(Site(pattern, region, tuple(targets), into, ("Linear",)))
    return sites


def apply_linear_group(gm: fx.GraphModule, site: Site) -> None:
    nodes = [_find_module_node(gm, t) for t in site.modules]
    inputs = {n.args[0] for n in nodes}
    if len(inputs) != 1 or any(len(n.args) != 1 or n.kwargs for n in nodes):
        raise LookupError(f"{site.modules} no longer read one shared input")
    mods = [gm.get_submodule(t) for t in site.modules]
    fused = concat_linears(mods)
    if isinstance(fused, str):
        raise ValueError(fused)
    gm.add_submodule(site.into, fused)
    sizes = [int(m.out_features) for m in mods]
    first = min(nodes, key=_order(gm))
    with gm.graph.inserting_before(first):
        out = gm.graph.call_module(site.into, (inputs.pop(),))
        parts = gm.graph.call_function(torch.split, (out, sizes), {"dim": -1})
        for i, node in enumerate(nodes):
            node.replace_all_uses_with(gm.graph.call_function(operator.getitem, (parts, i)))
    for node in nodes:
        gm.graph.erase_node(node)


def _order(gm: fx.GraphModule):  # noqa: ANN202
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return index.__getitem__


# -- silu(gate) * up ------------------------------------------------------------------------------
def _is_silu(gm: fx.GraphModule, node: Any) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function" and node.target in (F.silu, torch.nn.functional.silu):
        return not node.kwargs.get("inplace", False) and len(node.args) == 1
    return node.op == "call_module" and isinstance(_module(gm, node), nn.SiLU)


def _source(node: fx.Node) -> str:
    """The module a value comes from (through one split), naming a silu_mul site."""
    if node.op == "call_function" and node.target is operator.getitem:
        split = node.args[0]
        if isinstance(split, fx.Node) and split.target is torch.split:
            node = split.args[0]
    return str(node.target) if node.op == "call_module" else node.name


def _silu_mul_parts(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(mul, silu, up) when ``node`` is ``silu(gate) * up``."""
    if node.op != "call_function" or node.target not in (operator.mul, torch.mul) or len(node.args) != 2:
        return None
    a, b = node.args
    for silu, up in ((a, b), (b, a)):
        if _is_silu(gm, silu) and isinstance(up, fx.Node) and len(silu.users) == 1:
            return node, silu, up
    return None


def find_silu_mul(gm: fx.GraphModule, region: str) -> list[Site]:
    sites = []
    for node in gm.graph.nodes:
        parts = _silu_mul_parts(gm, node)
        if parts:
            _, silu, up = parts
            names = tuple(dict.fromkeys((_source(silu.args[0]), _source(up))))
            sites.append(Site("silu_mul", region, names, ops=("silu", "mul")))
    return sites


def _halves(gate: fx.Node, up: fx.Node) -> fx.Node | None:
    """The fused tensor when gate/up are the two equal halves of one split."""
    if not all(n.op == "call_function" and n.target is operator.getitem for n in (gate, up)):
        return None
    split = gate.args[0]
    if split is not up.args[0] or not isinstance(split, fx.Node) or split.target is not torch.split:
        return None
    sizes = split.args[1]
    if (gate.args[1], up.args[1]) != (0, 1) or len(sizes) != 2 or sizes[0] != sizes[1]:
        return None
    return split.args[0]


def apply_silu_mul(gm: fx.GraphModule, site: Site) -> None:
    for node in gm.graph.nodes:
        parts = _silu_mul_parts(gm, node)
        if not parts:
            continue
        mul, silu, up = parts
        if tuple(dict.fromkeys((_source(silu.args[0]), _source(up)))) != site.modules:
            continue
        gate = silu.args[0]
        whole = _halves(gate, up)
        with gm.graph.inserting_before(mul):
            if whole is not None:
                new = gm.graph.call_function(ops.swiglu, (whole,))
            else:
                new = gm.graph.call_function(ops.silu_mul, (gate, up))
            new.meta["is_wrapped"] = True
        mul.replace_all_uses_with(new)
        gm.graph.erase_node(mul)
        gm.graph.erase_node(silu)
        return
    raise LookupError(f"no silu(gate) * up over {site.modules}")


# -- RMSNorm ------------------------------------------------------------------------------------------
def rmsnorm_reason(module: nn.Module | None) -> str | None:
    from opus.models.decoder import RMSNorm

    if module is None:
        return "not a module call"
    if type(module) is not RMSNorm:
        return f"{type(module).__name__}: RMSNorm semantics unknown (only Opus RMSNorm is rewritten)"
    if module.offset:
        return "a (1 + weight) RMSNorm (gemma3): no fused kernel scales that way"
    return None


def _norm_nodes(gm: fx.GraphModule) -> list[tuple[fx.Node, nn.Module]]:
    out = []
    for node in gm.graph.nodes:
        m = _module(gm, node)
        if m is not None and type(m).__name__.endswith("RMSNorm") and len(node.args) == 1 and not node.kwargs:
            out.append((node, m))
    return out


def _residual_add(node: fx.Node) -> fx.Node | None:
    arg = node.args[0]
    if (isinstance(arg, fx.Node) and arg.op == "call_function" and arg.target in (operator.add, torch.add)
            and len(arg.args) == 2 and not arg.kwargs and all(isinstance(a, fx.Node) for a in arg.args)):
        return arg
    return None


def find_add_rmsnorm(gm: fx.GraphModule, region: str) -> list[Site]:
    return [Site("add_rmsnorm", region, (str(n.target),), ops=("add", type(m).__name__),
                 reason=rmsnorm_reason(m) or "")
            for n, m in _norm_nodes(gm) if _residual_add(n) is not None]


def find_rmsnorm(gm: fx.GraphModule, region: str) -> list[Site]:
    return [Site("rmsnorm", region, (str(n.target),), ops=(type(m).__name__,), reason=rmsnorm_reason(m) or "")
            for n, m in _norm_nodes(gm) if _residual_add(n) is None]


def apply_rmsnorm(gm: fx.GraphModule, site: Site) -> None:
    node = _find_module_node(gm, site.modules[0])
    module = gm.get_submodule(site.modules[0])
    eps = float(module.eps)
    if site.pattern == "rmsnorm":
        with gm.graph.inserting_before(node):
            weight = gm.graph.get_attr(f"{site.modules[0]}.weight")
            new = gm.graph.call_function(ops.rms_norm, (node.args[0], weight, eps))
            new.meta["is_wrapped"] = True
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        return
    add = _residual_add(node)
    if add is None:
        raise LookupError(f"{site.modules[0]} no longer follows a residual add")
    # Right after the add: every user of the sum comes later and can read it from the fused call.
    with gm.graph.inserting_after(add):
        weight = gm.graph.get_attr(f"{site.modules[0]}.weight")
    with gm.graph.inserting_after(weight):
        both = gm.graph.call_function(ops.add_rms_norm, (*add.args, weight, eps))
        both.meta["is_wrapped"] = True
    with gm.graph.inserting_after(both):
        total = gm.graph.call_function(operator.getitem, (both, 0))
    with gm.graph.inserting_after(total):
        normed = gm.graph.call_function(operator.getitem, (both, 1))
    node.replace_all_uses_with(normed)
    gm.graph.erase_node(node)
    add.replace_all_uses_with(total)
    gm.graph.erase_node(add)


FIND = {"linear_group": find_linear_groups, "silu_mul": find_silu_mul, "add_rmsnorm": find_add_rmsnorm,
        "rmsnorm": find_rmsnorm}
APPLY = {"qkv": apply_linear_group, "gate_up": apply_linear_group, "linear_group": apply_linear_group,
         "silu_mul": apply_silu_mul, "add_rmsnorm": apply_rmsnorm, "rmsnorm": apply_rmsnorm}
# Pattern names a user can switch off (``patterns:`` / ``ignore:``); linear groups report as qkv/gate_up.
PATTERNS = ("qkv", "gate_up", "linear_group", "silu_mul", "add_rmsnorm", "rmsnorm", "moe_grouped")


def rebuild(gm: fx.GraphModule, sites: list[Site]) -> fx.GraphModule:
    """Apply ``sites`` in order to a fresh trace ``gm`` and regenerate its code."""
    for site in sites:
        APPLY[site.pattern](gm, site)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm
