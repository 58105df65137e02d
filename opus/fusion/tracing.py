"""Regions, tracing and the ignore list.

Fusion never traces a whole LM: one untraceable part (a data-dependent branch, a dynamic mask)
would sink everything. It traces *regions* instead — the blocks (the items of each
``nn.ModuleList``: decoder layers, MoE experts) and every module with children inside them
(attention, MLP, MoE, a shared expert) — each on its own, with nested regions and childless modules
kept as opaque calls. A region that fails to trace is put on the ignore list with the trace error,
and the rest goes on.
"""

from __future__ import annotations

import fnmatch
import operator
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch.fx as fx
from torch import nn


@dataclass
class Ignore:
    """The ``ignore`` list from YAML: module-name globs, and op types.

    An op type is a pattern name (``qkv``, ``silu_mul`` ...), a module class name (``RMSNorm``,
    ``SparseMoE``) or an fx function name (``silu``, ``add``); it disables every site that involves it.
    """

    entries: list[str] = field(default_factory=list)

    def module_reason(self, name: str, module: nn.Module | None = None) -> str | None:
        """Why ``name`` (or a module it lives in) is ignored; ``module`` also matches class names."""
        for entry in self.entries:
            hit = _matching(name, entry)
            if hit is not None:
                return f"ignored by config ({entry!r}{'' if hit == entry else ' matches ' + hit})"
            if module is not None and type(module).__name__ == entry:
                return f"ignored by config (module type {entry!r})"
        return None

    def site_reason(self, pattern: str, modules: Iterable[str], ops: Iterable[str]) -> str | None:
        ops = set(ops) | {pattern}
        for entry in self.entries:
            if entry in ops:
                return f"ignored by config (op type {entry!r})"
            for name in modules:
                hit = _matching(name, entry)
                if hit is not None:
                    return f"ignored by config ({entry!r}{'' if hit == entry else ' matches ' + hit})"
        return None


def _matching(name: str, glob: str) -> str | None:
    """``name`` or the first enclosing module name (``a.b`` for ``a.b.c``) that ``glob`` matches."""
    parts = name.split(".") if name else []
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if fnmatch.fnmatchcase(prefix, glob):
            return prefix
    return None


def is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential))


def blocks(model: nn.Module) -> list[str]:
    """Qualified names of the items of every ModuleList (decoder layers, MoE experts)."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            out.extend(f"{name}.{i}" if name else str(i) for i in range(len(module)))
    return out


def regions(model: nn.Module) -> list[str]:
    """Regions to trace, deepest first (a region is rewritten before the module that calls it).

    Every block is a region, and so is every non-container module with children inside a block
    (attention, MLP, MoE, a shared expert). Without any ModuleList (a generic model) the same rule
    applies from the root (name ``""``).
    """
    found = blocks(model) or [""]
    out: list[str] = []
    for block in found:
        for name, sub in model.get_submodule(block).named_modules(prefix=block):
            if not is_container(sub) and any(True for _ in sub.children()):
                out.append(name)
    return sorted(dict.fromkeys(out), key=lambda n: (-n.count(".") if n else 1, n))


class RegionTracer(fx.Tracer):
    """Keeps childless modules (linears, norms, quantized linears) and nested regions opaque."""

    def __init__(self, opaque: set[str]) -> None:
        super().__init__()
        self.opaque = opaque

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.opaque:
            return True
        if is_container(m):
            return False
        return not any(True for _ in m.children())


def release_dead_wrap_registrations() -> int:
    """Drop torch.fx's registrations of generated code that nothing uses any more; how many went.

    The code fx generates for a graph that calls a ``torch.fx.wrap``-ed function (Opus's fused ops)
    registers its globals in a process-wide table on every recompile, so that a retrace of that
    GraphModule keeps the call a leaf, and the table never lets go (torch 2.13). Every trace then
    patches every entry, live or dead: one process that fuses many models (a Ray worker, a server,
    the test suite) spent most of each trace there, and kept every generated module's globals.
    A globals dict that only the table still holds belongs to code no one can call again.
    """
    from torch.fx import _symbolic_trace

    table = getattr(_symbolic_trace, "_wrapped_fns_to_patch", None)
    if not isinstance(table, dict):  # a torch that keeps it otherwise: nothing to release
        return 0
    held = Counter(id(g) for g in table.values())
    # What a dict held by a local alone counts here (the local and getrefcount's argument on CPython 3.11;
    # interpreters that skip counting locals count less): measured, not assumed.
    probe: dict = {}
    unheld = sys.getrefcount(probe)
    dead = []
    for key in list(table):  # keys only: a list of the items would hold the dicts too
        frame_globals = table[key]
        if "__name__" not in frame_globals and sys.getrefcount(frame_globals) - held[id(frame_globals)] == unheld:
            dead.append(key)  # beyond the table's own references (one per wrapped name), only this local's
        del frame_globals
    for key in dead:
        del table[key]
    return len(dead)


def trace(module: nn.Module, opaque: set[str] | None = None) -> fx.GraphModule:
    """Trace ``module``; ``opaque`` names (relative to it) stay single call_module nodes."""
    release_dead_wrap_registrations()
    tracer = RegionTracer(opaque or set())
    graph = tracer.trace(module)
    gm = fx.GraphModule(tracer.root, graph, type(module).__name__)
    copy_plain_attributes(module, gm)
    return gm


def opaque_children(model: nn.Module, region: str, all_regions: Iterable[str]) -> set[str]:
    """Names, relative to ``region``, of the nested regions its trace must keep opaque."""
    prefix = f"{region}." if region else ""
    return {r[len(prefix):] for r in all_regions if r != region and r.startswith(prefix)}


def try_trace(model: nn.Module, region: str, all_regions: Iterable[str]) -> tuple[fx.GraphModule | None, str]:
    module = model.get_submodule(region)
    try:
        return trace(module, opaque_children(model, region, all_regions)), ""
    except Exception as exc:  # noqa: BLE001 - any trace failure puts the region on the ignore list
        message = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return None, f"trace failed: {message}"


def copy_plain_attributes(src: nn.Module, dst: nn.Module) -> None:
    """Keep ``layer_idx``, ``num_heads`` ... on the rewritten module for code that reads them."""
    for key, value in vars(src).items():
        if not key.startswith("_") and isinstance(value, (bool, int, float, str)) and not hasattr(dst, key):
            setattr(dst, key, value)
    dst.training = src.training


def node_count(gm: fx.GraphModule) -> int:
    """Nodes that compute: calls, without inputs/output, attribute reads and tuple/shape indexing
    (a fused GEMM's split outputs are pure indexing, not work)."""
    return sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")
               and n.target not in (operator.getitem, getattr))


def replace_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at ``name``; returns the (possibly new) root."""
    if not name:
        return new
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
    return model
