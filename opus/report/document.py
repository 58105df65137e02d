"""A run's report: ``report.md`` (PNGs beside it in ``report/``) and a self-contained ``report.html``.

Built from the run's small files only — summary.json, events.jsonl, run.json and the published
artifacts (plan.yaml, profile.json, fusion.json, decisions.json) — so a run checked out from git
reports the same.
A section whose input is absent says so instead of failing.
"""

from __future__ import annotations

import base64
import html
import json
import time
from pathlib import Path
from typing import Any

import yaml

from opus.atomic import read_json, write_bytes, write_text
from opus.errors import InputError
from opus.export.targets import EXPORTS_FILE
from opus.fusion.rewrite import FUSION_FILE
from opus.pipeline.events import EventLog
from opus.pipeline.run_files import ARTIFACTS_DIR, find_artifact
from opus.quant.plan_file import PLAN_FILE
from opus.report import plots
from opus.report.publish import REPORT_ASSETS, ratio_line
from opus.runtime.noise import as_range, how_measured, overlap, part_spreads, spread_key
from opus.runtime.profiling import PROFILE_FILE
from opus.runtime.timed_choice import DECISIONS_FILE

Block = tuple  # ("h", text) | ("p", text) | ("table", headers, rows) | ("img", name, alt) | ("note", text)
HEADLINE = (("throughput_tok_s", "P, tokens/s"), ("ttft_ms", "D, ms to first token"),
            ("peak_mem_mb", "peak memory, MB"), ("perplexity", "perplexity"), ("top1_accuracy", "top-1 accuracy"))


def _f(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _load_artifact(run_dir: Path, name: str) -> tuple[str, Any] | None:
    found = find_artifact(run_dir, name)
    if found is None:
        return None
    stage, path = found
    text = path.read_text(encoding="utf-8")
    return stage, (yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text))


# -- sections -----------------------------------------------------------------------------------
def _overview(run_dir: Path, summary: dict[str, Any], info: dict[str, Any]) -> list[Block]:
    created = info.get("created")
    rows = [["pipeline", info.get("name", "—")], ["status", summary.get("status")],
            ["final stage", summary.get("final_stage") or "none"],
            ["started", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created)) if created else "—"],
            ["host", info.get("host", "—")], ["resumed", str(max(0, len(info.get("starts", [])) - 1)) + " times"]]
    blocks: list[Block] = [("h", f"Opus run {summary.get('run_id', run_dir.name)}"), ("table", ["", ""], rows)]
    for reason in summary.get("reasons") or []:
        blocks.append(("note", f"{summary.get('status')}: {reason}"))
    if summary.get("error"):
        blocks.append(("note", f"error: {summary['error']}"))
    for warning in summary.get("warnings") or []:
        blocks.append(("note", f"warning: {warning}"))
    headline = _headline(summary)
    blocks.append(("h", "Result"))
    if headline:
        blocks += [("p", ratio_line(summary.get("ratios") or {}) or "no ratio to a baseline"),
                   ("table", ["measure", "baseline", "final", "ratio"], headline)]
        if any(NOISE_MARK in row[-1] for row in headline):
            blocks.append(("note", f"{NOISE_MARK}: the baseline's and the final's [min, max] over their repeats "
                                   "overlap, so the ratio may be noise (more workload.repeats narrow it down)"))
    else:
        blocks.append(("note", "no stage measured P, D, memory or perplexity"))
    return blocks


NOISE_MARK = "within noise"


def _headline(summary: dict[str, Any]) -> list[list[str]]:
    """measure, baseline, final, ratio rows; a timed measure shows its [min, max] over the repeats; a ratio
    measured side by side shows its interval over the paired rounds, any other is marked within noise when
    the baseline's and the final's ranges overlap (opus.runtime.noise)."""
    base, final, ratios = summary.get("baseline") or {}, summary.get("final") or {}, summary.get("ratios") or {}
    spreads = {part: part_spreads(summary, part) for part in ("baseline", "final")}
    rows = []
    for key, label in HEADLINE:
        if base.get(key) is None and final.get(key) is None:
            continue
        ranges = [as_range(spreads[part].get(spread_key(key))) for part in ("baseline", "final")]
        ratio = f"×{ratios[key]:.3f}" if key in ratios else "—"
        paired = (summary.get("ratio_intervals") or {}).get(key)
        if paired:  # measured side by side with the baseline: its interval, not the two ranges, says noise
            ratio += f" [{paired['low']:.3f}–{paired['high']:.3f} {how_measured(paired)}" + (
                ", noisy]" if paired["noisy"] else "]")
        elif key in ratios and overlap(*ranges):
            ratio += f" ({NOISE_MARK})"
        rows.append([label, _with_range(base.get(key), ranges[0]), _with_range(final.get(key), ranges[1]), ratio])
    return rows


def _with_range(value: Any, found: tuple[float, float] | None) -> str:
    return _f(value) if found is None or value is None else f"{_f(value)} [{_f(found[0])}–{_f(found[1])}]"


def _stages(summary: dict[str, Any], images: dict[str, bytes]) -> list[Block]:
    rows = []
    for s in summary.get("stages", []):
        shown = {k: v for k, v in s.get("metrics", {}).items() if isinstance(v, (int, float))}
        metrics = ", ".join(f"{k}={_f(v)}" for k, v in list(shown.items())[:6])
        rows.append([s["id"], s.get("uses"), s.get("status"), s.get("attempts"), _f(s.get("duration_s")),
                     metrics, s.get("note", "")])
    blocks: list[Block] = [("h", "Stages"),
                           ("table", ["stage", "uses", "status", "attempts", "seconds", "metrics", "note"], rows)]
    png = plots.waterfall(summary)
    if png:
        images["waterfall"] = png
        blocks.append(("img", "waterfall", "stage waterfall: P, D, memory and perplexity vs baseline"))
    else:
        blocks.append(("note", "no waterfall: no baseline, or no stage after it measured P, D, memory or perplexity"))
    return blocks


def _plan_layers(plan: Any) -> list[dict[str, Any]]:
    """Layers (or layer groups) with name, format, score, reason, from the plan's known shapes.

    ``score`` may be one number or, as the planner writes it, {format: Δce}: the sensitivity shown is
    then the worst candidate's (how much the layer would cost at the most aggressive format tried).
    """
    layers = plan.get("groups", plan.get("layers", [])) if isinstance(plan, dict) else plan
    if isinstance(layers, dict):  # {name: {format, score, reason}}
        layers = [{"name": k, **(v if isinstance(v, dict) else {"format": v})} for k, v in layers.items()]
    out = []
    for layer in layers or []:
        if not isinstance(layer, dict):
            continue
        score = layer.get("score")
        scores = {str(k): v for k, v in score.items() if isinstance(v, (int, float))} if isinstance(score, dict) else {}
        out.append(dict(layer, format=layer.get("format", layer.get("precision")),
                        score=max(scores.values()) if scores else score,
                        scores=", ".join(f"{k} {v:.4g}" for k, v in scores.items())))
    return out


def _precision(run_dir: Path, images: dict[str, bytes]) -> list[Block]:
    blocks: list[Block] = [("h", "Precision per layer")]
    found = _load_artifact(run_dir, PLAN_FILE)
    layers = _plan_layers(found[1]) if found else []
    if not layers:
        return blocks + [("note", "no precision plan in this run (no plan.yaml artifact)")]
    images["precision"] = plots.precision_map(layers)
    formats: dict[str, int] = {}
    for layer in layers:
        formats[str(layer.get("format"))] = formats.get(str(layer.get("format")), 0) + 1
    blocks.append(("p", f"from stage '{found[0]}': " + ", ".join(f"{n} × {f}" for f, n in formats.items())))
    predicted = found[1].get("predicted") if isinstance(found[1], dict) else None
    if isinstance(predicted, dict) and predicted:
        blocks.append(("p", "predicted: " + ", ".join(f"{k} {_f(v)}" for k, v in predicted.items())))
    sweep = found[1].get("sensitivity") if isinstance(found[1], dict) else None
    if isinstance(sweep, dict) and sweep:  # the planner's sweep: how it scored, how much a resume reused
        blocks.append(("p", f"sensitivity: {sweep.get('method')} (top-k {sweep.get('top_k') or 'all'}), "
                            f"{sweep.get('units')} units: {sweep.get('measured')} measured, "
                            f"{sweep.get('reused')} reused from an earlier attempt"))
        ran_on = sweep.get("ran_on")
        if isinstance(ran_on, dict) and ran_on:  # where each unit was scored: the stage itself or cluster workers
            blocks.append(("p", "scored on: " + "; ".join(f"{where}: {n} units" for where, n in ran_on.items())))
    where = any("scored_on" in x for x in layers)  # a sweep on a cluster: which worker scored each group
    blocks += [("img", "precision", "precision map with sensitivity scores"),
               ("table", ["layer", "format", "sensitivity", "score per format", *(["scored on"] if where else []),
                          "reason"],
                [[x.get("name"), x.get("format"), _f(x.get("score")), x["scores"],
                  *([_where(x.get("scored_on"))] if where else []), x.get("reason", "")] for x in layers])]
    return blocks


def _where(scored_on: Any) -> str:
    """One worker, or the worker per format when the group's formats ran on several."""
    if isinstance(scored_on, dict):
        return "; ".join(f"{fmt}: {w}" for fmt, w in scored_on.items())
    return str(scored_on or "")


def _profile(run_dir: Path, images: dict[str, bytes]) -> list[Block]:
    blocks: list[Block] = [("h", "Profile hotspots")]
    found = _load_artifact(run_dir, PROFILE_FILE)
    groups_raw = (found[1] or {}).get("groups", {}) if found and isinstance(found[1], dict) else {}
    groups = {k: float(v.get("share", 0.0) if isinstance(v, dict) else v) for k, v in groups_raw.items()}
    if not groups:
        return blocks + [("note", "no profile in this run (no profile.json artifact)")]
    modules = []
    for m in found[1].get("modules", []) if isinstance(found[1].get("modules"), list) else []:
        value_key = "share" if "share" in m else next((k for k, v in m.items() if isinstance(v, (int, float))), None)
        if value_key:
            modules.append((str(m.get("name", m.get("module", "?"))), float(m[value_key]), value_key))
    modules.sort(key=lambda m: m[1], reverse=True)
    images["hotspots"] = plots.hotspots(groups, [(n, v) for n, v, _ in modules[:15]])
    shares = []
    if all(key in found[1] for key in ("groups", "workload")):
        images["profile_shares"] = plots.profile_shares(found[1])
        shares = [("img", "profile_shares", "time share by role: prefill, decode and the weighted workload")]
    def details(group: Any) -> str:  # scalars only: per-phase dicts would drown the table
        items = group.items() if isinstance(group, dict) else []
        return ", ".join(f"{k}={_f(v)}" for k, v in items if k != "share" and isinstance(v, (int, float)))

    rows = [[role, f"{share * 100:.1f}%", details(groups_raw[role])]
            for role, share in sorted(groups.items(), key=lambda kv: kv[1], reverse=True)]
    return blocks + [("p", f"from stage '{found[0]}'"), ("img", "hotspots", "profile hotspots"), *shares,
                     ("table", ["role", "share", "details"], rows)]


def _fusion(run_dir: Path, images: dict[str, bytes]) -> list[Block]:
    blocks: list[Block] = [("h", "Fusion")]
    found = _load_artifact(run_dir, FUSION_FILE)
    data = found[1] if found and isinstance(found[1], dict) else {}
    raw = next((data[k] for k in ("counts", "fused") if isinstance(data.get(k), dict)), data)
    fusion_counts = {str(k): float(v) for k, v in raw.items() if isinstance(v, (int, float))}
    if not fusion_counts:
        return blocks + [("note", "no fusion in this run (no fusion.json artifact with counts)")]
    images["fusion"] = plots.counts(fusion_counts, "fused patterns")
    blocks += [("p", f"from stage '{found[0]}'"), ("img", "fusion", "fusion counts")]
    ignored = data.get("ignored") or data.get("skipped") or []
    if isinstance(ignored, list) and ignored:
        blocks.append(("table", ["not fused", "reason"],
                       [[i.get("name", i.get("module", "?")), i.get("reason", "")] if isinstance(i, dict)
                        else [str(i), ""] for i in ignored]))
    return blocks


def _exports(run_dir: Path) -> list[Block]:
    """Every export target: exported or not (with the reason), where, and how it was checked."""
    blocks: list[Block] = [("h", "Exports")]
    found = _load_artifact(run_dir, EXPORTS_FILE)
    if found is None or not isinstance(found[1], dict):
        return blocks + [("note", f"no export in this run (no {EXPORTS_FILE} artifact)")]
    stage, data = found
    rows = []
    for name, target in (data.get("targets") or {}).items():
        if target.get("exported"):
            notes = target.get("layers_not_as_planned") or {}
            detail = f"{len(notes)} layers stored differently from the plan" if notes else ""
            rows.append([name, "exported", target.get("path") or "", detail])
        else:
            rows.append([name, "not exported", "", target.get("reason") or ""])
    return blocks + [("p", f"from stage '{stage}', in {data.get('export_dir', '?')}"),
                     ("table", ["target", "status", "path", "notes"], rows)]


def _decisions(run_dir: Path, summary: dict[str, Any]) -> list[Block]:
    """Every choice made from timings (opus.runtime.timed_choice): medians, the noise margin, the winner, why."""
    blocks: list[Block] = [("h", "Decisions from timings")]
    order = [s["id"] for s in summary.get("stages", [])]
    root = run_dir / ARTIFACTS_DIR
    found = sorted(root.glob(f"*/{DECISIONS_FILE}") if root.is_dir() else [],
                   key=lambda p: order.index(p.parent.name) if p.parent.name in order else len(order))
    rows = []
    for path in found:
        for d in json.loads(path.read_text(encoding="utf-8")).get("decisions", []):
            timed = sorted((c for c in d.get("candidates", []) if c.get("median") is not None),
                           key=lambda c: c["median"])
            medians = ", ".join(f"{c['name']} {_f(c['median'])}" for c in timed) or "—"
            margin = "—" if d.get("replayed_from") else f"{d.get('margin', 0):.1%}"
            rows.append([path.parent.name, d.get("what"), f"{medians} ({d.get('unit')})" if timed else medians,
                         margin, d.get("winner"), d.get("reason", "")])
    if not rows:
        return blocks + [("note", "no stage of this run chose from timings (no decisions.json artifact)")]
    return blocks + [("p", "medians of interleaved rounds; options within the noise margin of the fastest are "
                           "tied, and the more accurate, then the simpler of them wins"),
                     ("table", ["stage", "decision", "medians", "margin", "winner", "why"], rows)]


def timeline_data(events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Attempt segments and marks (rollbacks, reuses, discards, resumes) in seconds since the start."""
    if not events:
        return [], []
    t0 = events[0]["time"]
    open_: dict[str, float] = {}
    segments, marks = [], []
    for e in events:
        name, stage, t = e["event"], e.get("stage"), e["time"] - t0
        if name == "stage_started":
            open_[stage] = t
        elif name in ("stage_done", "rollback") and stage in open_:
            segments.append({"stage": stage, "start": open_.pop(stage), "end": t,
                             "outcome": "done" if name == "stage_done" else "rollback"})
        if name == "rollback":
            marks.append({"stage": stage, "time": t, "kind": "rollback",
                          "label": f"{e.get('reason')} → {e.get('action')}"})
        elif name == "stage_cached":
            segments.append({"stage": stage, "start": t, "end": t, "outcome": "cached"})
        elif name == "checkpoint_discarded":
            marks.append({"stage": stage, "time": t, "kind": "discarded", "label": f"discarded: {e.get('reason')}"})
        elif name == "run_resumed":
            marks.append({"stage": None, "time": t, "kind": "resumed", "label": "resumed"})
    end = events[-1]["time"] - t0
    segments += [{"stage": s, "start": start, "end": end, "outcome": "open"} for s, start in open_.items()]
    return segments, marks


def _timeline(run_dir: Path, summary: dict[str, Any], images: dict[str, bytes]) -> list[Block]:
    blocks: list[Block] = [("h", "Timeline: gates, rollbacks and retries")]
    png = plots.timeline(*timeline_data(EventLog(run_dir).read()))
    if png:
        images["timeline"] = png
        blocks.append(("img", "timeline", "timeline of stage attempts, rollbacks and retries"))
    else:
        blocks.append(("note", "no events.jsonl"))
    gates = [[s["id"], c["metric"], c["bound"], _f(c["threshold"]), _f(c.get("measured")), _f(c.get("baseline")),
              "pass" if c["passed"] else f"FAIL: {c.get('reason', '')}"]
             for s in summary.get("stages", []) for c in (s.get("gate") or {}).get("checks", [])]
    blocks.append(("h", "Gates (final attempts)"))
    blocks.append(("table", ["stage", "metric", "bound", "threshold", "measured", "baseline", "verdict"], gates)
                  if gates else ("note", "no gate was evaluated on a kept stage"))
    rollbacks = [[r["stage"], r["attempt"], r["kind"], r["reason"], _f(json.dumps(r["remedy"])
                  if isinstance(r.get("remedy"), dict) else r.get("remedy")), r["action"], r.get("restored")]
                 for r in summary.get("rollbacks", [])]
    blocks.append(("h", "Rollbacks and retries"))
    blocks.append(("table", ["stage", "attempt", "kind", "reason", "remedy", "action", "restored"], rollbacks)
                  if rollbacks else ("note", "no rollback"))
    return blocks


# -- rendering ----------------------------------------------------------------------------------
def _md_cell(value: Any) -> str:
    return _f(value).replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: list[Block]) -> str:
    out, first = [], True
    for block in blocks:
        kind = block[0]
        if kind == "h":
            out.append(("# " if first else "## ") + block[1])
            first = False
        elif kind == "p":
            out.append(block[1])
        elif kind == "note":
            out.append(f"> {block[1]}")
        elif kind == "img":
            out.append(f"![{block[2]}]({REPORT_ASSETS}/{block[1]}.png)")
        elif kind == "table":
            headers, rows = block[1], block[2]
            lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
            out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


CSS = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
       "table{border-collapse:collapse;margin:.5em 0;font-size:.9em}td,th{border:1px solid #ccc;padding:3px 8px;"
       "text-align:left;vertical-align:top}th{background:#f3f3f3}img{max-width:100%}"
       ".note{color:#666;font-style:italic}")


def render_html(blocks: list[Block], images: dict[str, bytes]) -> str:
    out, title = [], "Opus report"
    for block in blocks:
        kind = block[0]
        if kind == "h":
            tag = "h1" if not out else "h2"
            title = block[1] if tag == "h1" else title
            out.append(f"<{tag}>{html.escape(block[1])}</{tag}>")
        elif kind == "p":
            out.append(f"<p>{html.escape(block[1])}</p>")
        elif kind == "note":
            out.append(f'<p class="note">{html.escape(block[1])}</p>')
        elif kind == "img":
            data = base64.b64encode(images[block[1]]).decode("ascii")
            out.append(f'<figure id="{block[1]}"><img alt="{html.escape(block[2])}" '
                       f'src="data:image/png;base64,{data}"></figure>')
        elif kind == "table":
            head = "".join(f"<th>{html.escape(h)}</th>" for h in block[1])
            body = "".join("<tr>" + "".join(f"<td>{html.escape(_f(c))}</td>" for c in row) + "</tr>"
                           for row in block[2])
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style></head><body>\n" + "\n".join(out) + "\n</body></html>\n")


def build(run_dir: Path) -> tuple[list[Block], dict[str, bytes]]:
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise InputError("no summary.json (the run has not finished; `opus status` shows where it is)",
                         file=str(run_dir))
    summary = read_json(summary_path)
    info = read_json(run_dir / "run.json") if (run_dir / "run.json").is_file() else {}
    images: dict[str, bytes] = {}
    blocks = (_overview(run_dir, summary, info) + _stages(summary, images) + _precision(run_dir, images)
              + _profile(run_dir, images) + _fusion(run_dir, images) + _exports(run_dir) + _decisions(run_dir, summary)
              + _timeline(run_dir, summary, images))
    return blocks, images


def write_report(run_dir: Path) -> list[Path]:
    """Write report.md, report/*.png and report.html into the run directory (each file atomically)."""
    run_dir = Path(run_dir)
    blocks, images = build(run_dir)
    assets = run_dir / REPORT_ASSETS
    for stale in assets.glob("*.png") if assets.is_dir() else []:
        if stale.stem not in images:
            stale.unlink()
    written = []
    for name, png in images.items():
        write_bytes(assets / f"{name}.png", png)
        written.append(assets / f"{name}.png")
    write_text(run_dir / "report.md", render_markdown(blocks))
    write_text(run_dir / "report.html", render_html(blocks, images))
    return [run_dir / "report.md", run_dir / "report.html", *written]
