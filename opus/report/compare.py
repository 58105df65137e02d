"""``opus compare A B``: metrics flattened to dotted keys, old / new / Δ / Δ% / direction per key,
changed parameters.

A and B are run directories, ``REV:path/to/run`` or git revisions (their latest committed run). The
command refuses a side that cannot be read (one line on stderr, exit 2); the renderers here still
show a side's error for callers that want both sides anyway.

Direction says whether a change is ``better`` or ``worse`` (knowing which metrics are higher- or
lower-is-better), or ``within noise`` when both sides' ranges over their repeats overlap (the rule
and its justification: opus.runtime.noise). The spreads themselves (``<key>_spread.*``) are not rows: they
are the ranges of their metric's row.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from opus.report.history import RunAt
from opus.runtime.noise import SPREAD_SUFFIX, Range, as_range, overlap, part_spreads

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
    for part in ("baseline", "final"):  # their spreads, from the stage records when the summary lacks them
        out.update(flatten(part_spreads(summary, part), part))
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


def split_spreads(flat: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Range]]:
    """Flat metrics without their ``<key>_spread.*`` entries, and those spreads as ``{key: (min, max)}``."""
    values: dict[str, Any] = {}
    spreads: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        head, _, field = key.rpartition(".")
        if head.endswith(SPREAD_SUFFIX):
            spreads.setdefault(head.removesuffix(SPREAD_SUFFIX), {})[field] = value
        else:
            values[key] = value
    ranges = {key: found for key, spread in spreads.items() if (found := as_range(spread)) is not None}
    return values, ranges


# Which way is good, by the metric's own name (a key's last part, before/after suffixes removed).
HIGHER_IS_BETTER = re.compile(r"tok_s|speedup|agreement|cosine|top5_overlap|top1_accuracy|exact_match")
LOWER_IS_BETTER = re.compile(r"_ms(_|$)|_mb(_|$)|^perplexity$|ppl_increase|abs_diff")


def sense(key: str) -> int:
    """+1 when higher is better, -1 when lower is better, 0 when the metric has no good direction."""
    name = re.sub(r"_(before|after)$", "", key.rpartition(".")[2])
    if HIGHER_IS_BETTER.search(name):
        return 1
    return -1 if LOWER_IS_BETTER.search(name) else 0


@dataclass
class Row:
    key: str
    old: Any
    new: Any
    delta: float | None = None
    delta_pct: float | None = None
    old_range: Range | None = None  # [min, max] over the old side's repeats, where recorded
    new_range: Range | None = None
    direction: str = ""  # better | worse | within noise | unchanged | changed | added | removed

    @property
    def changed(self) -> bool:
        return self.old != self.new


def direction(row: Row) -> str:
    """better / worse by the metric's sense, unless the two sides' ranges overlap (within noise)."""
    if not row.changed:
        return "unchanged"
    if row.old is None or row.new is None:
        return "added" if row.old is None else "removed"
    if row.delta is None or not sense(row.key):
        return "changed"
    if overlap(row.old_range, row.new_range):
        return "within noise"
    return "better" if row.delta * sense(row.key) > 0 else "worse"


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


def compare_runs(a: RunAt, b: RunAt, only: Iterable[str] = ()) -> Comparison:
    """Rows of every metric (only the keys matching one of the ``only`` globs, when given)."""
    old, old_ranges = split_spreads(summary_metrics(a.summary) if a.summary else {})
    new, new_ranges = split_spreads(summary_metrics(b.summary) if b.summary else {})
    params_old = pipeline_params(a.pipeline) if a.pipeline else {}
    params_new = pipeline_params(b.pipeline) if b.pipeline else {}
    params = [r for r in diff_metrics(params_old, params_new) if r.changed] if a.pipeline and b.pipeline else []
    globs = list(only)
    rows = [r for r in diff_metrics(old, new) if not globs or any(fnmatchcase(r.key, g) for g in globs)]
    for row in rows:
        row.old_range, row.new_range = old_ranges.get(row.key), new_ranges.get(row.key)
        row.direction = direction(row)
    return Comparison(a, b, rows, params)


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
        lines += ["| key | old | new | Δ | Δ% | direction |", "|---|---:|---:|---:|---:|---|"]
        lines += [f"| {r.key} | {_md_cell(fmt(r.old))} | {_md_cell(fmt(r.new))} | {' | '.join(fmt_delta(r))} "
                  f"| {r.direction} |" for r in rows]
    else:
        lines.append("no metric differs" if cmp.ok else "nothing to compare")
    lines += ["", "### Changed parameters", ""]
    if cmp.params:
        lines += ["| key | old | new |", "|---|---|---|"]
        lines += [f"| {r.key} | {_md_cell(fmt(r.old))} | {_md_cell(fmt(r.new))} |" for r in cmp.params]
    else:
        lines.append("none" if cmp.a.pipeline and cmp.b.pipeline else "no pipeline.yaml on one side")
    return "\n".join(lines) + "\n"


DIRECTION_STYLE = {"better": "green", "worse": "red", "within noise": "dim"}


def print_rich(cmp: Comparison, labels: tuple[str, str], show_all: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    for name, label, run in (("A", labels[0], cmp.a), ("B", labels[1], cmp.b)):
        state = f"[red]error: {run.error}[/]" if run.error else (run.summary or {}).get("status", "")
        console.print(f"{name}  {label}  →  {run.where}  {state}")
    table = Table(title="metrics" + ("" if show_all else " (changed)"), show_lines=False)
    for column, justify in (("key", "left"), ("old", "right"), ("new", "right"), ("Δ", "right"), ("Δ%", "right"),
                            ("direction", "left")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in (r for r in cmp.metrics if show_all or r.changed):
        style = DIRECTION_STYLE.get(row.direction)
        shown = f"[{style}]{row.direction}[/]" if style else row.direction
        table.add_row(row.key, fmt(row.old), fmt(row.new), *fmt_delta(row), shown)
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
