"""The report's and ``opus log --plot``'s figures, as PNG bytes (matplotlib's object API, Agg canvas).

``Figure`` is used directly rather than pyplot: no global backend or figure registry, so plotting
works headless and inside any process.
"""

from __future__ import annotations

import io
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from opus.runtime.profiling import PHASES, ROLES

MEASURES = (("throughput_tok_s", "P (throughput)"), ("ttft_ms", "D (time to first token)"),
            ("peak_mem_mb", "peak memory"), ("perplexity", "perplexity"))
OUTCOME_COLORS = {"done": "tab:green", "cached": "tab:gray", "rollback": "tab:red", "open": "tab:orange"}
MAX_LAYERS_PLOTTED = 200


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return buf.getvalue()


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def waterfall(summary: dict[str, Any]) -> bytes | None:
    """P, D, memory and perplexity after each kept stage, as ratios to the baseline (1.0 = baseline)."""
    baseline = summary.get("baseline") or {}
    stages = [s for s in summary.get("stages", []) if s.get("status") in ("done", "cached", "rolled_back")]
    panels = [(key, title) for key, title in MEASURES if _num(baseline.get(key))
              and any(_num(s["metrics"].get(key)) for s in stages if not s.get("baseline"))]
    if not panels:
        return None
    fig = Figure(layout="constrained", figsize=(4.2 * len(panels), 3.6))
    names = [s["id"] for s in stages]
    for index, (key, title) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), index + 1)
        base = float(baseline[key])
        for x, stage in enumerate(stages):
            value = _num(stage["metrics"].get(key))
            if value is None:
                ax.text(x, 1.0, "not\nmeasured", ha="center", va="bottom", fontsize=7, color="gray")
                continue
            color = "tab:gray" if stage.get("baseline") else "tab:blue"
            ax.bar(x, value / base, color=color, width=0.6)
            ax.text(x, value / base, f"×{value / base:.2f}", ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("ratio to baseline", fontsize=8)
        ax.margins(y=0.15)
    return _png(fig)


def precision_map(layers: list[dict[str, Any]]) -> bytes:
    """One bar per layer: its sensitivity score, coloured by the precision it was given."""
    shown = layers[:MAX_LAYERS_PLOTTED]
    formats = list(dict.fromkeys(str(layer.get("format")) for layer in shown))
    palette = {f: f"C{i % 10}" for i, f in enumerate(formats)}
    fig = Figure(layout="constrained", figsize=(8, max(2.5, 0.16 * len(shown) + 1)))
    ax = fig.add_subplot(1, 1, 1)
    y = range(len(shown))
    scores = [_num(layer.get("score")) or 0.0 for layer in shown]
    ax.barh(list(y), scores, color=[palette[str(layer.get("format"))] for layer in shown])
    ax.set_yticks(list(y), [str(layer.get("name")) for layer in shown], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("sensitivity score (the plan's; for per-format scores, the worst format tried)", fontsize=8)
    fig.legend(handles=[Patch(color=palette[f], label=f) for f in formats], title="format", fontsize=7,
               loc="outside right upper")
    title = "precision per layer"
    if len(layers) > len(shown):
        title += f" (first {len(shown)} of {len(layers)})"
    ax.set_title(title, fontsize=9)
    return _png(fig)


def hotspots(groups: dict[str, float], modules: list[tuple[str, float]]) -> bytes:
    """Share of time per layer role, and the top modules."""
    panels = 2 if modules else 1
    fig = Figure(layout="constrained", figsize=(5.5 * panels, max(2.5, 0.3 * max(len(groups), len(modules)) + 1)))
    ax = fig.add_subplot(1, panels, 1)
    ordered = sorted(groups.items(), key=lambda kv: kv[1], reverse=True)
    ax.barh([k for k, _ in ordered], [v * 100 for _, v in ordered], color="tab:orange")
    ax.invert_yaxis()
    ax.set_xlabel("% of profiled time", fontsize=8)
    ax.set_title("time by role", fontsize=9)
    if modules:
        ax2 = fig.add_subplot(1, panels, 2)
        ax2.barh([n for n, _ in modules], [v * 100 for _, v in modules], color="tab:purple")
        ax2.set_xlabel("% of profiled time", fontsize=8)
        ax2.invert_yaxis()
        ax2.tick_params(axis="y", labelsize=6)
        ax2.set_title("top modules", fontsize=9)
    return _png(fig)


def counts(values: dict[str, float], title: str) -> bytes:
    fig = Figure(layout="constrained", figsize=(6, max(2.0, 0.3 * len(values) + 1)))
    ax = fig.add_subplot(1, 1, 1)
    ax.barh(list(values), list(values.values()), color="tab:cyan")
    ax.invert_yaxis()
    for y, v in enumerate(values.values()):
        ax.text(v, y, f" {v:g}", va="center", fontsize=7)
    ax.set_title(title, fontsize=9)
    return _png(fig)


def timeline(segments: list[dict[str, Any]], marks: list[dict[str, Any]]) -> bytes | None:
    """Stage attempts as bars over the run's wall time; rollbacks and resumes marked with their reason.

    ``segments``: {stage, start, end, outcome}; ``marks``: {stage or None, time, label, kind}.
    """
    if not segments and not marks:
        return None
    rows = list(dict.fromkeys(s["stage"] for s in segments))
    rows += [m["stage"] for m in marks if m.get("stage") and m["stage"] not in rows]
    fig = Figure(layout="constrained", figsize=(9, max(2.0, 0.45 * len(rows) + 1.2)))
    ax = fig.add_subplot(1, 1, 1)
    for seg in segments:
        width = max(seg["end"] - seg["start"], 0.01)
        ax.broken_barh([(seg["start"], width)], (rows.index(seg["stage"]) - 0.3, 0.6),
                       color=OUTCOME_COLORS.get(seg["outcome"], "tab:blue"), edgecolor="white", linewidth=1.5)
    for mark in marks:
        if mark.get("stage") in rows:
            y = rows.index(mark["stage"])
            ax.plot(mark["time"], y, marker="x" if mark["kind"] == "rollback" else "o", color="black")
            ax.annotate(mark["label"][:48], (mark["time"], y), xytext=(4, 6), textcoords="offset points",
                        fontsize=6)
        else:
            ax.axvline(mark["time"], color="gray", linestyle=":", linewidth=1)
            ax.text(mark["time"], len(rows) - 0.5, " " + mark["label"], fontsize=6, color="gray")
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_ylim(len(rows) - 0.4, -0.6)
    ax.set_xlabel("seconds since the run started", fontsize=8)
    fig.legend(handles=[Patch(color=c, label=k) for k, c in OUTCOME_COLORS.items()], fontsize=7,
               loc="outside right upper")
    ax.set_title("stage attempts, rollbacks and retries", fontsize=9)
    return _png(fig)


def history(entries: list[dict[str, Any]]) -> bytes:
    """Ratios to each run's baseline over history (oldest left); ``entries``: {label, ratios}."""
    fig = Figure(layout="constrained", figsize=(max(6, 0.6 * len(entries) + 2), 3.8))
    ax = fig.add_subplot(1, 1, 1)
    xs = list(range(len(entries)))
    for key, title in MEASURES:
        ys = [_num((e.get("ratios") or {}).get(key)) for e in entries]
        if any(v is not None for v in ys):
            ax.plot(xs, [float("nan") if v is None else v for v in ys], marker="o", label=title)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(xs, [e["label"] for e in entries], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("ratio to the run's baseline", fontsize=8)
    ax.set_title("Opus runs over history", fontsize=9)
    ax.legend(fontsize=7)
    return _png(fig)


def profile_shares(profile: dict[str, Any]) -> bytes:
    """A PNG bar chart of time share by role for prefill, decode and the weighted workload."""
    series = {p: profile[p]["shares"] for p in PHASES if profile.get(p)}
    series["workload"] = {role: g["share"] for role, g in profile["groups"].items()}
    roles = [r for r in ROLES if any(s.get(r, 0) > 0 for s in series.values())] or list(ROLES)
    fig = Figure(figsize=(7, 0.18 * len(roles) * len(series) + 1.4), dpi=100)
    ax = fig.add_subplot()
    height = 0.8 / len(series)
    for i, (label, shares) in enumerate(series.items()):
        ys = [j + i * height for j in range(len(roles))]
        ax.barh(ys, [100 * shares.get(r, 0.0) for r in roles], height=height, label=label)
    ax.set_yticks([j + height * (len(series) - 1) / 2 for j in range(len(roles))], roles)
    ax.invert_yaxis()
    ax.set_xlabel("share of time (%)")
    work = profile["workload"]
    ax.set_title(f"Time by role — batch {work['batch_size']}, input {work['input_len']}, "
                 f"{work['output_len']} decode steps")
    ax.legend(loc="lower right")
    fig.tight_layout()
    return _png(fig)
