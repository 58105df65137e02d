"""What ``opus bench --serve`` shows and writes: a table per server per concurrency with the ratios
opus / llama.cpp, ``serve.md``, ``serve.json`` and ``serve.png`` (output tok/s and p99 TTFT against
the number of concurrent clients, both servers)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

# (key of a level's record, column title, format)
COLUMNS = (("output_tok_s", "out tok/s", "{:.1f}"), ("requests_s", "req/s", "{:.2f}"),
           ("ttft_ms_p50", "TTFT p50 ms", "{:.1f}"), ("ttft_ms_p99", "TTFT p99 ms", "{:.1f}"),
           ("itl_ms_p50", "ITL p50 ms", "{:.2f}"), ("itl_ms_p99", "ITL p99 ms", "{:.2f}"))
SERVERS = ("opus", "llama.cpp")


def _num(value: Any, fmt: str) -> str:
    return "—" if value is None else fmt.format(value)


def _ratio_at(report: dict[str, Any], concurrency: int) -> dict[str, Any]:
    return next((r for r in report["ratios"] if r["concurrency"] == concurrency), {})


def _ratio(ratio: dict[str, Any], key: str) -> str:
    """``1.23×`` and, over several rounds, ``[1.10–1.31]``: the median of the per-round ratios and their range;
    ``noisy`` when that range is wider than 15 % of the median."""
    value, span = ratio.get(key), ratio.get(f"{key}_range")
    if value is None:
        return "—"
    text = f"{value:.2f}×" + (f" [{span[0]:.2f}–{span[1]:.2f}]" if span and ratio.get("paired_rounds", 0) > 1 else "")
    return text + " noisy" if ratio.get(f"{key}_noisy") else text


def rows(report: dict[str, Any]) -> list[list[str]]:
    """One row per concurrency and server: the figures, errors, and on the opus row the ratios."""
    out = []
    for index, concurrency in enumerate(report["levels"]):
        ratio = _ratio_at(report, concurrency)
        for name in SERVERS:
            level = report["servers"][name]["levels"][index]
            if level is None:
                out.append([str(concurrency), name] + ["—"] * len(COLUMNS) + ["server not running", "", ""])
                continue
            errors = str(level["errors"]) + (f" ({level['short']} short)" if level["short"] else "")
            cells = [str(concurrency), name] + [_num(level[key], fmt) for key, _, fmt in COLUMNS] + [errors]
            if name == "opus":
                cells += [_ratio(ratio, "output_tok_s"), _ratio(ratio, "ttft_ms_p99")]
            else:
                cells += ["", ""]
            out.append(cells)
    return out


HEADERS = ["clients", "server", *(title for _, title, _ in COLUMNS), "errors", "tok/s opus/llama",
           "p99 TTFT opus/llama"]


SHORT_HEADERS = ["clients", "server", "tok/s", "req/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "errors",
                 "tok/s ×", "p99 TTFT ×"]


def table(report: dict[str, Any]) -> Table:
    """The console's table: short headers, what they mean in the caption."""
    t = Table(title=f"opus bench --serve: {report['run']} (input {report['input_len']}, output "
                    f"{report['output_len']} tokens, {report['threads']} threads)", title_justify="left",
              caption="latencies in ms; × = opus / llama.cpp at the same number of clients, the median of the "
                      "rounds' ratios [min–max], noisy when wider than 15 % (tok/s: higher is better for opus, p99 "
                      "TTFT: lower)", caption_justify="left")
    for index, header in enumerate(SHORT_HEADERS):
        t.add_column(header, justify="left" if index < 2 else "right", no_wrap=True)
    for index, cells in enumerate(rows(report)):
        t.add_row(*cells, end_section=index % len(SERVERS) == len(SERVERS) - 1)
    return t


def _errors(report: dict[str, Any]) -> list[str]:
    lines = []
    for name in SERVERS:
        for level in report["servers"][name]["levels"]:
            if level and level["first_error"]:
                lines.append(f"- {name} at {level['concurrency']} clients: {level['errors']} errors, the first: "
                             f"{level['first_error']}")
    return lines


def to_markdown(report: dict[str, Any]) -> str:
    lines = [f"# opus bench --serve: {report['run']}", "",
             f"- input {report['input_len']} tokens, output {report['output_len']} tokens (fixed), "
             f"{report['threads']} threads for each server; prompts: {report['prompt_source']}",
             "- requests per level and round: " + ", ".join(f"{c} clients: {n}" for c, n in report["requests"].items()),
             f"- rounds per level: {report['rounds']}; order of the rounds: "
             + "; ".join(f"{r['concurrency']} clients: " + ", ".join(" then ".join(o) for o in r["orders"])
                         for r in report["ratios"]),
             f"- {report['environment']}"]
    for name in SERVERS:
        lines += [f"- {name}: " + "; ".join(report["servers"][name]["notes"])]
    lines += _errors(report)
    lines += ["", "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows(report)]
    lines += ["", f"How: {report['method']}."]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any]) -> bytes:
    """Output tok/s (higher is better) and p99 TTFT (lower is better) against concurrent clients."""
    from matplotlib.figure import Figure

    fig = Figure(layout="constrained", figsize=(10, 4))
    for index, (key, title) in enumerate((("output_tok_s", "output tokens/s"), ("ttft_ms_p99", "p99 TTFT (ms)"))):
        ax = fig.add_subplot(1, 2, index + 1)
        for name, style in zip(SERVERS, ("o-", "s--")):
            points = [(level["concurrency"], level[key]) for level in report["servers"][name]["levels"]
                      if level and level[key] is not None]
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(report["levels"], [str(c) for c in report["levels"]])
        ax.set_xlabel("concurrent clients")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, default=str) + "\n"


def emit(report: dict[str, Any], fmt: str, out: Path) -> None:
    """Print the table (rich; or the JSON with ``fmt == "json"``) and write serve.md, serve.json and
    serve.png into ``out``."""
    from opus.atomic import write_bytes, write_text

    if fmt == "json":
        print(to_json(report), end="")
    else:
        console = Console(highlight=False)
        if not console.is_terminal:  # a pipe or a log: whole rows, not the 80 columns rich assumes there
            console = Console(highlight=False, width=160)
        console.print(table(report))
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "serve.md", to_markdown(report))
    write_text(out / "serve.json", to_json(report))
    write_bytes(out / "serve.png", plot(report))
    print(f"wrote {out / 'serve.md'}, serve.json, serve.png", file=sys.stderr)
