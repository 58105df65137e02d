"""``opus compare A B``: metrics flattened to dotted keys, old / new / Δ / Δ% per key, changed parameters.

A and B are run directories, ``REV:path/to/run`` or git revisions (their latest committed run). A
side that cannot be read is shown with its error; the other side is still shown.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from opus.history import RunAt

SUMMARY_PARTS = ("baseline", "final", "ratios")


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts and lists to ``a.b.0.c`` keys; scalars kept as they are."""
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, list):
        items = ((str(i), v) for i, v in enumerate(obj))
    else:
        return {prefix: obj}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def summary_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """``status``, ``baseline.*``, ``final.*``, ``ratios.*`` and ``stages.<id>.metrics.*``."""
    out: dict[str, Any] = {"status": summary.get("status"), "final_stage": summary.get("final_stage")}
    for part in SUMMARY_PARTS:
        out.update(flatten(summary.get(part) or {}, part))
    for record in summary.get("stages", []):
        out.update(flatten(record.get("metrics") or {}, f"stages.{record['id']}.metrics"))
    out["rollbacks"] = len(summary.get("rollbacks", []))
    return {k: v for k, v in out.items() if v is not None}


def pipeline_params(pipeline: dict[str, Any]) -> dict[str, Any]:
    """The pipeline flattened, stages keyed by id (so inserting a stage does not shift every key)."""
    data = dict(pipeline)
    stages = data.pop("stages", None) or []
    out = flatten(data)
    for index, stage in enumerate(stages):
        stage = dict(stage) if isinstance(stage, dict) else {"value": stage}
        out.update(flatten(stage, f"stages.{stage.pop('id', index)}"))
    return out


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


@dataclass
class Row:
    key: str
    old: Any
    new: Any
    delta: float | None = None
    delta_pct: float | None = None

    @property
    def changed(self) -> bool:
        return self.old != self.new


def diff_metrics(old: dict[str, Any], new: dict[str, Any]) -> list[Row]:
    rows = []
    for key in _ordered_keys(old, new):
        a, b = old.get(key), new.get(key)
        row = Row(key, a, b)
        x, y = _number(a), _number(b)
        if x is not None and y is not None:
            row.delta = y - x
            row.delta_pct = (y - x) / abs(x) * 100 if x else None
        rows.append(row)
    return rows


def _ordered_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    seen = dict.fromkeys(old)
    seen.update(dict.fromkeys(new))
    return list(seen)


@dataclass
class Comparison:
    a: RunAt
    b: RunAt
    metrics: list[Row]
    params: list[Row]

    @property
    def ok(self) -> bool:
        return self.a.error is None and self.b.error is None


def compare_runs(a: RunAt, b: RunAt) -> Comparison:
    old = summary_metrics(a.summary) if a.summary else {}
    new = summary_metrics(b.summary) if b.summary else {}
    params_old = pipeline_params(a.pipeline) if a.pipeline else {}
    params_new = pipeline_params(b.pipeline) if b.pipeline else {}
    params = [r for r in diff_metrics(params_old, params_new) if r.changed] if a.pipeline and b.pipeline else []
    return Comparison(a, b, diff_metrics(old, new), params)


# -- output ------------------------------------------------------------------------------------------
def fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def fmt_delta(row: Row) -> tuple[str, str]:
    delta = f"{row.delta:+.6g}" if row.delta is not None else ""
    pct = f"{row.delta_pct:+.2f}%" if row.delta_pct is not None else ""
    return delta, pct


def _side(label: str, run: RunAt) -> dict[str, Any]:
    return {"label": label, "where": run.where, "pipeline": run.run_info.get("name"),
            "status": (run.summary or {}).get("status"), "error": run.error}


def to_json(cmp: Comparison, labels: tuple[str, str], show_all: bool) -> str:
    metrics = [r.__dict__ for r in cmp.metrics if show_all or r.changed]
    params = [{"key": r.key, "old": r.old, "new": r.new} for r in cmp.params]
    return json.dumps({"a": _side(labels[0], cmp.a), "b": _side(labels[1], cmp.b), "metrics": metrics,
                       "params": params}, indent=2, default=str)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(cmp: Comparison, labels: tuple[str, str], show_all: bool) -> str:
    lines = ["| side | given | run | status | error |", "|---|---|---|---|---|"]
    for name, label, run in (("A (old)", labels[0], cmp.a), ("B (new)", labels[1], cmp.b)):
        side = _side(label, run)
        lines.append("| " + " | ".join(_md_cell(fmt(v)) for v in (name, label, side["where"], side["status"],
                                                                   side["error"] or "")) + " |")
    rows = [r for r in cmp.metrics if show_all or r.changed]
    lines += ["", "### Metrics" + ("" if show_all else " (changed)"), ""]
    if rows:
        lines += ["| key | old | new | Δ | Δ% |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {r.key} | {_md_cell(fmt(r.old))} | {_md_cell(fmt(r.new))} | {' | '.join(fmt_delta(r))} |"
                  for r in rows]
    else:
        lines.append("no metric differs" if cmp.ok else "nothing to compare")
    lines += ["", "### Changed parameters", ""]
    if cmp.params:
        lines += ["| key | old | new |", "|---|---|---|"]
        lines += [f"| {r.key} | {_md_cell(fmt(r.old))} | {_md_cell(fmt(r.new))} |" for r in cmp.params]
    else:
        lines.append("none" if cmp.a.pipeline and cmp.b.pipeline else "no pipeline.yaml on one side")
    return "\n".join(lines) + "\n"


def print_rich(cmp: Comparison, labels: tuple[str, str], show_all: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    for name, label, run in (("A", labels[0], cmp.a), ("B", labels[1], cmp.b)):
        state = f"[red]error: {run.error}[/]" if run.error else (run.summary or {}).get("status", "")
        console.print(f"{name}  {label}  →  {run.where}  {state}")
    table = Table(title="metrics" + ("" if show_all else " (changed)"), show_lines=False)
    for column, justify in (("key", "left"), ("old", "right"), ("new", "right"), ("Δ", "right"), ("Δ%", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in (r for r in cmp.metrics if show_all or r.changed):
        table.add_row(row.key, fmt(row.old), fmt(row.new), *fmt_delta(row))  # no colour: up is not always good
    console.print(table)
    if cmp.params:
        params = Table(title="changed parameters")
        for column in ("key", "old", "new"):
            params.add_column(column)
        for row in cmp.params:
            params.add_row(row.key, fmt(row.old), fmt(row.new))
        console.print(params)
    else:
        console.print("changed parameters: none" if cmp.a.pipeline and cmp.b.pipeline
                      else "changed parameters: no pipeline.yaml on one side")
