"""Every stage type's options, read from its pydantic ``Config``: ``opus stages NAME`` and docs/stages.md.

The reference is generated, never written by hand: ``opus stages --markdown > docs/stages.md`` rewrites it,
and a test fails when the file is stale. Nested models (a plan's ``budget``, ``sensitivity``) become
dotted keys, as a pipeline's ``with:`` and ``--set`` name them.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

HEADER = ("# Stage reference\n\nGenerated from each stage type's pydantic `Config` by `opus stages --markdown` "
          "(do not edit by hand). A stage's options go under its `with:` in a pipeline file; nested options "
          "are written as mappings (`budget: {max_ppl_increase: 0.01}`) or, on the command line, as dotted "
          "keys (`--set stages.plan.with.budget.max_ppl_increase=0.01`).\n")


def _type_name(annotation: Any) -> str:
    """A type as a pipeline's author reads it: validators dropped (``Annotated``), unions with ``|``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return f"Literal[{', '.join(repr(a) for a in args)}]"
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def _default(field: Any) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        value = field.default_factory()
    else:
        return "required"
    if isinstance(value, BaseModel):
        return "(see below)"
    return json.dumps(value, default=str)


def _nested(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return None


def option_rows(config: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) of every option, nested models flattened."""
    rows = []
    for name, field in config.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        rows.append((key, _type_name(field.annotation), _default(field), " ".join((field.description or "").split())))
        if (model := _nested(field.annotation)) is not None:
            rows.extend(option_rows(model, f"{key}."))
    return rows


def stage_markdown(name: str) -> str:
    from opus.pipeline.registry import known_stage_types, load_stage_type

    stage = load_stage_type(name)
    doc = (stage.module.__doc__ or "").strip().split("\n\n")[0]
    lines = [f"## `{name}` ({known_stage_types().get(name, name)})", "", " ".join(doc.split()), "",
             "| option | type | default | description |", "|---|---|---|---|"]
    for key, kind, default, description in option_rows(stage.config_class):
        cells = [f"`{key}`", f"`{kind}`", f"`{default}`", description]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def reference_markdown() -> str:
    from opus.pipeline.registry import known_stage_types

    return HEADER + "".join("\n" + stage_markdown(name) for name in sorted(known_stage_types()))
