"""``opus compare``, ``opus log``, ``opus report`` and what happens after a run (report, commit).

opus.cli.main only registers these: ``add_parsers(sub)`` and ``COMMANDS``; heavy imports (git, matplotlib)
happen inside the commands.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from opus.errors import EXIT_INVALID, EXIT_OK, InputError


def add_parsers(sub: Any) -> None:
    compare = sub.add_parser("compare", help="compare two runs: git revisions, REV:path/to/run, or run directories")
    compare.add_argument("a", help="old side: a run directory, a git revision or REV:path/to/run")
    compare.add_argument("b", nargs="?", default=None, help="new side (default: the working tree's latest run = HEAD)")
    compare.add_argument("--format", choices=("table", "md", "json"), default=None,
                         help="output format (default: a table on a terminal, else markdown)")
    compare.add_argument("--all", action="store_true", help="show unchanged metrics too")
    compare.add_argument("--only", action="append", default=[], metavar="GLOB",
                         help="only metric keys matching this glob, e.g. 'final.*' or '*ttft_ms' (repeatable)")
    log = sub.add_parser("log", help="the runs committed in the history of the current branch")
    log.add_argument("rev", nargs="?", default="HEAD")
    log.add_argument("-n", "--max-count", type=int, default=None, help="look at this many run commits at most")
    log.add_argument("--plot", type=Path, metavar="FILE.png", help="plot P, D, memory and perplexity ratios")
    report = sub.add_parser("report", help="(re)write a run's report.md and report.html")
    report.add_argument("run_dir", type=Path)


def cmd_compare(args: argparse.Namespace) -> int:
    from opus.report.compare import compare_runs, print_rich, to_json, to_markdown
    from opus.report.history import resolve_run

    labels = (args.a, args.b or "HEAD")
    a, b = resolve_run(labels[0]), resolve_run(labels[1])
    errors = [f"{label}: {run.error}" for label, run in zip(labels, (a, b), strict=True) if run.error]
    if errors:  # nothing on stdout: a script piping the table or JSON must not mistake half of it for a result
        print("error: " + "; ".join(errors).replace("\n", " "), file=sys.stderr)
        return EXIT_INVALID
    cmp = compare_runs(a, b, args.only)
    fmt = args.format or ("table" if sys.stdout.isatty() else "md")
    if fmt == "json":
        print(to_json(cmp, labels, args.all))
    elif fmt == "md":
        print(to_markdown(cmp, labels, args.all), end="")
    else:
        print_rich(cmp, labels, args.all)
    return EXIT_OK


def log_lines(runs: list[Any]) -> list[str]:
    from opus.report.publish import ratio_line

    lines = []
    for run in runs:
        date = time.strftime("%Y-%m-%d %H:%M", time.localtime(run.date)) if run.date else "?"
        summary = run.summary or {}
        name = run.run_info.get("name") or "?"
        shown = run.error or ratio_line(summary.get("ratios") or {}) or "no ratios"
        lines.append(f"{run.commit[:8]}  {date}  {name:<16} {summary.get('status', '?'):<11} {shown}  {run.path}")
    return lines


def cmd_log(args: argparse.Namespace) -> int:
    from opus.report.history import open_repo, runs_in_history

    repo = open_repo(Path.cwd())
    if not repo.head.is_valid():
        if args.rev != "HEAD":  # nothing to resolve it against
            raise InputError(f"unknown revision '{args.rev}': the repository has no commits yet")
        print("no commits yet")
        return EXIT_OK
    runs = runs_in_history(repo, args.rev, args.max_count)
    if not runs:
        print(f"no committed run in the history of {args.rev}")
    for line in log_lines(runs):
        print(line)
    if args.plot and runs:
        from opus.atomic import write_bytes
        from opus.report import plots

        entries = [{"label": f"{r.commit[:7]} {r.run_info.get('name', '')}".strip(),
                    "ratios": (r.summary or {}).get("ratios")} for r in reversed(runs)]
        write_bytes(args.plot, plots.history(entries))
        print(f"plot: {args.plot}")
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from opus.report.document import write_report
    from opus.report.publish import publish

    if not args.run_dir.is_dir():
        raise InputError("no such run directory", file=str(args.run_dir))
    publish(args.run_dir)
    for path in write_report(args.run_dir)[:2]:
        print(f"report: {path}")
    return EXIT_OK


COMMANDS = {"compare": cmd_compare, "log": cmd_log, "report": cmd_report}


def finish_run(run_dir: Path, summary: dict[str, Any], commit: bool) -> None:
    """After the run (already safe on disk): publish small files, write the report, commit if asked.

    Nothing here may lose the run or change the exit code: failures are one-line warnings.
    """
    def warn(text: str) -> None:
        print(f"warning: {text}", file=sys.stderr)

    try:
        from opus.report.document import write_report
        from opus.report.publish import publish

        publish(run_dir)
        report = write_report(run_dir)
        print(f"  report    {report[1]}")
    except Exception as exc:  # noqa: BLE001 - a report bug must not cost the night's run
        warn(f"report not written: {type(exc).__name__}: {exc}".splitlines()[0])
    if not commit:
        return
    if summary.get("status") == "interrupted":
        warn("the run was interrupted, so it is not committed; `opus resume --commit` commits it when done")
        return
    from opus.errors import OpusError
    from opus.report.history import commit_run

    try:
        done = commit_run(run_dir)
    except OpusError as exc:
        warn(f"run not committed: {exc}")
        return
    except Exception as exc:  # noqa: BLE001 - e.g. a git error; the run stays on disk
        warn(f"run not committed: {type(exc).__name__}: {exc}".splitlines()[0])
        return
    if done is None:
        print("  git       nothing new to commit (the run's files are committed unchanged)")
    else:
        print(f"  git       committed {done.sha[:10]} on {done.branch} ({len(done.paths)} files)")
        if done.warning:
            warn(done.warning)
