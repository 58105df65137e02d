"""YAML loading that remembers where every key came from, so errors can name file and line.

A pipeline file is small, hand-written YAML, so anything far beyond that is refused before it can
cost memory or time: files over ``MAX_BYTES``, text that is not UTF-8, nesting deeper than
``MAX_DEPTH`` (PyYAML's composer recurses per level) and documents whose aliases expand to more than
``MAX_NODES`` nodes ("billion laughs": a few kB that would otherwise expand to gigabytes in every
consumer that walks the data). Each is one ``InputError`` line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from opus.errors import InputError

Loc = tuple[Any, ...]

MAX_BYTES = 1 << 20  # 1 MiB: a pipeline is a few kB
MAX_DEPTH = 64
MAX_NODES = 100_000  # counted with every alias expanded


class _LimitError(yaml.YAMLError):
    def __init__(self, problem: str, mark: yaml.Mark | None) -> None:
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys and documents nested beyond ``MAX_DEPTH``."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        # Checked while composing: the composer recurses a few frames per level, so a deep
        # document would otherwise end in a RecursionError before any limit could be applied.
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _LimitError(f"nested more than {MAX_DEPTH} levels deep", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:  # a list or mapping as a key
            raise yaml.constructor.ConstructorError(
                None, None, f"a key must be a plain value, not a {key_node.id}", key_node.start_mark) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key '{key}' (first on line {seen[key]})", key_node.start_mark)
        seen[key] = key_node.start_mark.line + 1
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _expanded_size(root: yaml.Node) -> int:
    """Nodes in the document with every alias expanded, in time linear in the distinct nodes.

    An alias is the same node object as its anchor, so sizes are memoized per node; the walk is
    iterative (post-order) so that it needs no recursion either. A node that contains an alias to
    itself would expand forever: refused.
    """
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            open_nodes.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in _children(node))
            continue
        if id(node) in sizes:
            continue
        if id(node) in open_nodes:
            raise _LimitError("an alias refers to a node that contains it (a recursive document)",
                              node.start_mark)
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)
    return sizes[id(root)]


def _record_lines(node: yaml.Node, loc: Loc, lines: dict[Loc, int], visited: set[int]) -> None:
    # An aliased node is walked once: keys under a later alias resolve (via line_of) to the line
    # of their nearest recorded parent, and the walk stays linear in the file's size.
    if id(node) in visited:
        return
    visited.add(id(node))
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            child = (*loc, key_node.value)
            lines.setdefault(child, key_node.start_mark.line + 1)
            _record_lines(value_node, child, lines, visited)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            child = (*loc, index)
            lines.setdefault(child, item.start_mark.line + 1)
            _record_lines(item, child, lines, visited)


def _decode(raw: bytes, file: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise InputError(f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at offset {exc.start} "
                         "(save the file as UTF-8)", file=file, line=line) from None


def parse_yaml(text: str, file: str) -> tuple[Any, yaml.Node | None]:
    """Compose, check the limits, then construct: (data, the root node); errors are InputErrors."""
    try:
        # The reader checks every character as it is built: a control byte is an error here already.
        loader = _UniqueKeyLoader(text)
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise InputError(f"not a YAML text: {str(exc).splitlines()[0]}", file=file, line=line) from None
    try:
        node = loader.get_single_node()
        if node is not None and (size := _expanded_size(node)) > MAX_NODES:
            raise _LimitError(f"the document expands to {size} nodes with its aliases; at most {MAX_NODES} "
                              "are accepted", node.start_mark)
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        context = getattr(exc, "context", None)
        prefix = "" if isinstance(exc, _LimitError) else "YAML syntax error: "
        message = prefix + problem + (f" ({context})" if context else "")
        raise InputError(message, file=file, line=mark.line + 1 if mark else None) from None
    except RecursionError:  # a safety net: the depth limit should make this unreachable
        raise InputError(f"nested more than {MAX_DEPTH} levels deep", file=file) from None
    finally:
        loader.dispose()
    return data, node


def load_yaml_with_lines(path: Path) -> tuple[Any, dict[Loc, int]]:
    """Parse ``path``; return the data and a map from key path to 1-based line number."""
    if path.is_dir():
        run = (path / "run.json").is_file()  # run_files.RUN_FILE (run_files imports this module, via spec)
        raise InputError("a directory, not a pipeline file" + ("; it is a run directory: `opus resume` continues "
                         "it, `opus verify` checks its files" if run else ""), file=str(path))
    if not path.is_file():
        raise InputError("file not found", file=str(path))
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise InputError(f"{size} bytes is too large for a pipeline file (at most {MAX_BYTES})", file=str(path))
    data, node = parse_yaml(_decode(path.read_bytes(), str(path)), str(path))
    lines: dict[Loc, int] = {}
    if node is not None:
        _record_lines(node, (), lines, set())
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
