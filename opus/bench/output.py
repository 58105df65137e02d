"""The bench table as Markdown and JSON, and the speed-against-accuracy plot (PNG, matplotlib Agg)."""

from __future__ import annotations

import io
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from opus.bench.core import Row

METHODS = {
    "timing": "every contender is built and kept (in groups when they would not all fit in memory, each "
              "group with the fp32 baseline), then timed in interleaved rounds: one untimed warm-up round, "
              "then `repeats` rounds (at least 5 when there are ratios), each running every contender once "
              "(its P request, then its D requests), round r starting at contender r mod N, so a slow moment "
              "of the machine hits every contender and none is always first or last",
    "P": "generated tokens/s of the workload: batch_size prompts of input_len tokens, output_len new tokens "
         "each, prefill included (median over the rounds)",
    "D": "time to first token of one request of input_len tokens (prefill + choosing the first token), "
         "median of 9 or more requests spread over the rounds",
    "prefill bN": "time to the first tokens of the P workload: all batch_size prompts prefilled at once "
                  "(median over the rounds; lower is better)",
    "decode bN": "tokens/s of the decode steps of the P workload (batch N = batch_size, prefill excluded)",
    "decode b1": "tokens/s of the decode steps of that single request (batch 1)",
    "peak MB": "the process's peak resident memory during the contender's first batch run after its warm-up, "
               "measured right after its build, less what the contenders built before it held then (the "
               "process's memory before this build less its memory before any contender): the peak of the "
               "process with this contender alone loaded (freed heap is returned to the OS before each build)",
    "rise MB": "how far the peak rose above the resident memory at the start of that batch run: what "
               "the workload itself needed (activations, KV cache, runtime buffers)",
    "model MB": "bytes of parameters and buffers (torch), of the ONNX graph, or of the GGUF file",
    "b1 % of bound": "decode b1 as a share of the memory-bandwidth bound: the machine's copy bandwidth (STREAM's "
                     "copy, read + written bytes, measured before any contender) over the bytes a token reads "
                     "(model MB times the share of the model one token uses: top_k of a MoE's experts, not an "
                     "untied input embedding; the KV cache left out) (opus.bench.bandwidth)",
    "ppl": "perplexity over the evaluation blocks (the same token ids for every contender)",
    "agree": "teacher-forced greedy agreement: on the baseline's own greedy continuation of the fidelity "
             "prompts, the fraction of positions where the contender's argmax equals the baseline's",
    "agree free": "free-running greedy agreement: the contender generates from the same prompt ids and each "
                  "token is compared with the baseline's at the same position",
    "×": "ratio to the fp32 baseline measured in the same run; for a timed figure the median of the ratios of "
         "the rounds (contender / baseline, both from the same round), with [min–max] over the rounds; an "
         "interval wider than 15 % of the ratio is measured again once (every contender of the group), and "
         "marked noisy if it still is; memory, size and perplexity: the plain quotient",
}
PROMPTS = {"text": "cut from the evaluation text", "random": "seeded random token ids"}
# Columns shown with their ratio to the baseline, then the model size.
RATIO_COLUMNS = (("throughput_tok_s", "P tok/s", "{:.1f}"), ("prefill_ms_batch", "prefill bN ms", "{:.1f}"),
                 ("decode_tok_s_batch", "decode bN tok/s", "{:.1f}"),
                 ("ttft_ms", "D ms", "{:.1f}"), ("decode_tok_s", "decode b1 tok/s", "{:.1f}"),
                 ("peak_mem_mb", "peak MB", "{:.0f}"))
MODEL_COLUMN = ("model_mb", "model MB", "{:.1f}")
SHORT = {"throughput_tok_s": "P", "prefill_ms_batch": "prefill bN", "decode_tok_s_batch": "decode bN", "ttft_ms": "D",
         "decode_tok_s": "decode b1"}


def _num(value: Any, fmt: str) -> str:
    return fmt.format(value) if isinstance(value, (int, float)) and math.isfinite(value) else "—"


def _ratio(value: Any, interval: dict[str, Any] | None) -> str:
    """``1.23 [1.10–1.31]``: the paired ratio with its interval over the rounds; ``noisy`` when too wide."""
    text = _num(value, "{:.2f}")
    if text == "—" or not interval:
        return text
    text += f" [{interval['low']:.2f}–{interval['high']:.2f}]"
    return text + " noisy" if interval.get("noisy") else text


def _timing_lines(timing: dict[str, Any] | None, rows: list[Row]) -> list[str]:
    """How the timed figures were taken: interleaved rounds, their order, groups, drift, noisy ratios."""
    if not timing:
        return []
    groups = [g for g in timing.get("groups", []) if g.get("orders")]
    if not groups:
        return []
    first = groups[0]
    n = len(first["contenders"])
    shown = "; ".join(f"round {i + 1}: {', '.join(order)}" for i, order in enumerate(first["orders"][:min(n, 3)]))
    rounds = " / ".join(str(g["rounds"]) for g in groups)
    repeated = " (measured again: an interval was wider than 15 %)" if any(g.get("repeated") for g in groups) else ""
    lines = [f"- timing: interleaved; every contender built and kept, then a warm-up round and {rounds} timed "
             f"rounds{repeated}, each running every contender once, round r starting at contender r mod {n} "
             f"({shown}{'; …' if len(first['orders']) > 3 else ''}); D: {first['ttft_requests_per_round']} "
             "requests per contender per round; × is the median of the per-round ratios to fp32 [min–max]"]
    if timing.get("grouping"):
        lines.append(f"- memory: {timing['grouping']}: "
                     + "; ".join(f"group {i + 1}: {', '.join(g['contenders'])}" for i, g in enumerate(groups)))
    spread = rows[0].metrics.get("throughput_tok_s_spread") if rows else None
    if isinstance(spread, dict) and spread.get("median"):
        lines.append(f"- fp32 P over its {spread['n']} rounds: {spread['min']:.1f}–{spread['max']:.1f} tok/s "
                     f"({(spread['max'] - spread['min']) / spread['median'] * 100:.0f} % of its median: how much the "
                     "machine moved meanwhile; the paired ratios cancel what hit every contender of a round)")
    noisy = {row.name: [SHORT.get(k, k) for k, i in row.intervals.items() if i.get("noisy")] for row in rows}
    if any(noisy.values()):
        lines.append("- noisy ratios (interval still wider than 15 % after a repeat): "
                     + "; ".join(f"{name} ({', '.join(keys)})" for name, keys in noisy.items() if keys))
    return lines


def _bandwidth_line(bandwidth: dict[str, Any] | None) -> list[str]:
    if not bandwidth or not bandwidth.get("copy_gb_s"):
        return []
    return [f"- memory bandwidth: {bandwidth['copy_gb_s']:.1f} GB/s (copy, {bandwidth['threads']} threads, before any "
            f"contender); a token reads {bandwidth['read_fraction'] * 100:.0f} % of a model's bytes"]


def _verdict(row: Row, budget: float) -> str:
    if row.status != "ok":
        return row.status
    return {"within": "✓ within", "over": "✗ over"}.get(row.verdict, "n/a")


def to_markdown(report: dict[str, Any], rows: list[Row]) -> str:
    budget = report["budget"]["value"]
    w = report["workload"]
    lines = [f"# opus bench: {report['pipeline']}", "",
             f"- workload: batch {w['batch_size']}, input {w['input_len']}, output {w['output_len']}, "
             f"warm-up {w['warmup']}, repeats {w['repeats']}; prompts: {PROMPTS[report['prompt_source']]}",
             f"- evaluation: {report['evaluation']}",
             f"- agreement: {report['fidelity']}",
             f"- accuracy budget: perplexity +{budget * 100:g} % ({report['budget']['source']})",
             *_bandwidth_line(report.get("bandwidth")),
             f"- Opus run: {report['run'] or report['no_run_reason']}",
             f"- {report['environment']}"]
    lines += _timing_lines(report.get("timing"), rows)
    lines.append("")
    head = ["contender"] + [f"{label} | ×" for _, label, _ in RATIO_COLUMNS] + [
        "rise MB", MODEL_COLUMN[1], "b1 % of bound", "ppl", "Δppl", "agree", "agree free", f"≤ +{budget * 100:g} %"]
    cells_per_row = len(" | ".join(head).split(" | "))
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * cells_per_row)
    for row in rows:
        if row.status != "ok":
            lines.append(f"| {row.name} | " + " | ".join(["—"] * (cells_per_row - 2))
                         + f" | {row.status}: {row.reason} |")
            continue
        m, r = row.metrics, row.ratios
        cells = [row.name]
        for key, _, fmt in RATIO_COLUMNS:
            cells += [_num(m.get(key), fmt), _ratio(r.get(key), row.intervals.get(key))]
        share = m.get("decode_bound_share")
        cells += [_num(m.get("peak_mem_rise_mb"), "{:.0f}"), _num(m.get("model_mb"), MODEL_COLUMN[2]),
                  _num(None if share is None else share * 100, "{:.0f} %"),
                  _num(m.get("perplexity"), "{:.3f}"),
                  _num(None if row.ppl_increase is None else row.ppl_increase * 100, "{:+.2f} %"),
                  _num(m.get("agreement"), "{:.3f}"), _num(m.get("agreement_free"), "{:.3f}"), _verdict(row, budget)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Contenders", ""]
    for row in rows:
        took = f" ({row.seconds:.1f} s)" if row.seconds else ""
        lines.append(f"- **{row.name}** — {row.label}{took}" + (f": {row.status}: {row.reason}" if row.reason else ""))
        lines += [f"  - {note}" for note in row.notes]
    lines += ["", "## How each figure is measured", ""]
    lines += [f"- **{name}**: {text}" for name, text in METHODS.items()]
    return "\n".join(lines) + "\n"


def emit(report: dict[str, Any], rows: list[Row], fmt: str, out: Path | None,
         extra_files: dict[str, str] | None = None) -> None:
    """Print the bench in ``fmt`` (markdown or json); with ``out``, also write bench.md, bench.json,
    bench.png and ``extra_files`` (name -> text) there."""
    from opus.atomic import write_bytes, write_text

    markdown, json_text = to_markdown(report, rows), to_json(report, rows)
    print(json_text if fmt == "json" else markdown, end="")
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "bench.md", markdown)
    write_text(out / "bench.json", json_text)
    write_bytes(out / "bench.png", plot(rows, report["budget"]["value"]))
    for name, text in (extra_files or {}).items():
        write_text(out / name, text)
    print(f"wrote {out / 'bench.md'}, bench.json, bench.png" + "".join(f", {n}" for n in extra_files or {}),
          file=sys.stderr)


def to_json(report: dict[str, Any], rows: list[Row]) -> str:
    return json.dumps({**report, "methods": METHODS, "rows": [asdict(r) for r in rows]}, indent=2, default=str) + "\n"


def plot(rows: list[Row], budget: float) -> bytes:
    """P and decode speed (×baseline) against perplexity increase (%), one point per measured contender."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(layout="constrained", figsize=(11, 4.4))
    measured = [r for r in rows if r.status == "ok" and r.ppl_increase is not None]
    for index, (key, title) in enumerate((("throughput_tok_s", "P (batch workload)"),
                                          ("decode_tok_s", "decode at batch 1"))):
        ax = fig.add_subplot(1, 2, index + 1)
        for row in measured:
            speed = row.ratios.get(key)
            if speed is None:
                continue
            x = row.ppl_increase * 100
            color = "tab:green" if row.verdict == "within" else "tab:red"
            ax.scatter([x], [speed], color=color, zorder=3)
            ax.annotate(row.name, (x, speed), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.axvline(budget * 100, color="gray", linestyle="--", linewidth=0.8, label=f"budget +{budget * 100:g} %")
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_xscale("symlog", linthresh=1.0)  # int8 activations can cost 100s of % next to fractions of 1 %
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.set_xlabel("perplexity increase (%)")
        ax.set_ylabel("speed × fp32 baseline")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, loc="best")
        ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()
