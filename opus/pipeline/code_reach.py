"""The code a stage's result can depend on: its module and every module it can reach, by import.

A stage key hashes these sources only (not the whole ``opus`` package), so fixing a typo in the report,
a plot, the command line or a benchmark re-runs nothing. Reach is found statically: every ``import``
in a module's source, at top level or inside a function, within the stage module's own top-level
package and ``opus``; importing ``a.b.c`` also runs ``a`` and ``a.b``. Modules that a checkpoint names
in a string (recipe providers, KV-cache kinds) are not visible to imports, so the worker's roots add
them: ``opus.recipe`` and everything under ``opus.kv``, ``opus.quant`` and ``opus.fusion`` that a
recipe step may load.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
from pathlib import Path

# What runs every stage (worker, its context, the state it rebuilds) and what a recipe can load by
# name; the stage module's own imports are added to these.
WORKER_ROOTS = ("opus.pipeline.worker", "opus.recipe", "opus.kv.cache", "opus.kv.pool", "opus.kv.static",
                "opus.quant.apply", "opus.fusion.rewrite")
# Rooms whose code never changes what a stage computes: a stage that imported them would be a bug.
NEVER_REACHED = ("opus.report", "opus.cli", "opus.bench")


@functools.cache
def _origin(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


def _is_package(name: str) -> bool:
    origin = _origin(name)
    return origin is not None and origin.name == "__init__.py"


def _absolute(name: str, level: int, current: str) -> str:
    if level == 0:
        return name
    base = current if _is_package(current) else current.rpartition(".")[0]
    for _ in range(level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{name}" if name else base


@functools.cache
def imports_of(name: str) -> frozenset[str]:
    """Modules that ``name``'s source imports (absolute names, whether or not they are ours)."""
    origin = _origin(name)
    if origin is None:
        return frozenset()
    found: set[str] = set()
    tree = ast.parse(origin.read_text(), str(origin))
    typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block) for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node.module or "", node.level, name)
            found.add(module)
            # ``from pkg import mod`` imports a module, ``from mod import fn`` a name: keep modules only.
            found.update(f"{module}.{alias.name}" for alias in node.names if _origin(f"{module}.{alias.name}"))
    return frozenset(found)


def _is_type_checking(node: ast.AST) -> bool:
    """An ``if TYPE_CHECKING:`` block: its imports are for type checkers, never run."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def reach(roots: tuple[str, ...], packages: tuple[str, ...]) -> list[str]:
    """Every module under ``packages`` reachable by import from ``roots`` (roots included), sorted."""
    seen: set[str] = set()
    todo = [n for root in roots for n in _with_parents(root)]
    while todo:
        name = todo.pop()
        if name in seen or name.split(".")[0] not in packages or _origin(name) is None:
            continue
        seen.add(name)
        todo.extend(n for imported in imports_of(name) for n in _with_parents(imported))
    return sorted(seen)


def stage_reach(stage_module: str) -> list[str]:
    """The modules a stage type's result can depend on."""
    packages = tuple(sorted({"opus", stage_module.split(".")[0]}))
    return reach((stage_module, *WORKER_ROOTS), packages)


def stage_code_digest(stage_module: str) -> str:
    """sha256 over the names and sources of ``stage_reach(stage_module)``."""
    digest = hashlib.sha256()
    for name in stage_reach(stage_module):
        origin = _origin(name)
        assert origin is not None  # reach keeps only modules with a source file
        digest.update(name.encode() + b"\0" + origin.read_bytes() + b"\0")
    return digest.hexdigest()
