"""YAML loading that remembers where every key came from, so errors can name file and line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from opus.errors import InputError

Loc = tuple[Any, ...]


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys instead of keeping the last silently."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key '{key}' (first on line {seen[key]})", key_node.start_mark)
        seen[key] = key_node.start_mark.line + 1
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _record_lines(node: yaml.Node, loc: Loc, lines: dict[Loc, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            child = (*loc, key_node.value)
            lines[child] = key_node.start_mark.line + 1
            _record_lines(value_node, child, lines)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            child = (*loc, index)
            lines[child] = item.start_mark.line + 1
            _record_lines(item, child, lines)


def load_yaml_with_lines(path: Path) -> tuple[Any, dict[Loc, int]]:
    """Parse ``path``; return the data and a map from key path to 1-based line number."""
    if not path.is_file():
        raise InputError("file not found", file=str(path))
    text = path.read_text(encoding="utf-8")
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        context = getattr(exc, "context", None)
        message = f"YAML syntax error: {problem}" + (f" ({context})" if context else "")
        raise InputError(message, file=str(path), line=mark.line + 1 if mark else None) from None
    lines: dict[Loc, int] = {}
    if node is not None:
        _record_lines(node, (), lines)
    return data, lines


def line_of(lines: dict[Loc, int], loc: Loc) -> int | None:
    """The line of ``loc`` or of its nearest recorded parent (a missing key points at its parent)."""
    loc = tuple(loc)
    while loc:
        if loc in lines:
            return lines[loc]
        loc = loc[:-1]
    return None


def dotted(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
