"""``opus run``, ``resume``, ``verify``, ``check`` and ``stages``: running a pipeline and checking one."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from opus.errors import EXIT_DEGRADED, EXIT_INTERRUPTED, EXIT_OK, EXIT_RUN_FAILED, InputError

STATUS_EXIT = {"finished": EXIT_OK, "degraded": EXIT_DEGRADED, "failed": EXIT_RUN_FAILED,
               "interrupted": EXIT_INTERRUPTED}


def add_parsers(sub: Any) -> None:
    run = sub.add_parser("run", help="run a pipeline (resumes when --run-dir holds an earlier run)")
    run.add_argument("pipeline", type=Path)
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override any value for this run, e.g. stages.quantize.with.alpha=0.6")
    run.add_argument("--run-dir", type=Path, help="run directory (default: RUNS_DIR/<name>-<time>)")
    run.add_argument("--runs-dir", type=Path, default=Path("runs"))
    run.add_argument("--decisions-from", type=Path, metavar="RUN_DIR",
                     help="replay the timing decisions of an earlier run (its plan, KV cache and compile "
                          "choice) for exact reproduction; the same as --set run.decisions_from=RUN_DIR")
    run.add_argument("--quiet", action="store_true")
    resume = sub.add_parser("resume", help="continue a stopped or crashed run from its last checkpoint")
    resume.add_argument("run_dir", type=Path)
    resume.add_argument("--quiet", action="store_true")
    for command in (run, resume):
        command.add_argument("--commit", action="store_true",
                             help="commit the run's small files to git when it ends (as run.track: git)")
    verify = sub.add_parser("verify", help="check every checkpoint and the lineage; say what a resume would redo")
    verify.add_argument("run_dir", type=Path)
    stages = sub.add_parser("stages", help="list the installed stage types; with a name, that stage's options")
    stages.add_argument("name", nargs="?", help="a stage type: print its options (type, default, description)")
    stages.add_argument("--markdown", action="store_true",
                        help="every stage's options as Markdown (what docs/stages.md holds)")
    check = sub.add_parser("check", help="validate a pipeline without running it")
    check.add_argument("pipeline", type=Path)
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")


def execute(loaded: Any, run_dir: Path, quiet: bool, commit: bool = False) -> dict[str, Any]:
    """Run (or continue) ``loaded`` in ``run_dir`` as ``opus run`` does; returns the run's summary.

    Invalid input raises its OpusError before anything is written; a run that fails is a summary
    whose status says so. ``opus.run`` (the Python API) is this too.
    """
    from opus.cli.history import finish_run
    from opus.cli.run_display import RunDisplay
    from opus.pipeline.runner import Runner

    display = RunDisplay(quiet=quiet)
    runner = Runner(loaded, run_dir, display)  # validates before anything runs
    _preflight(loaded, runner.types)  # nothing is written before this passes
    with display:
        display.line(f"run {run_dir}  ({loaded.spec.name}, {len(loaded.spec.stages)} stages)")
        summary = runner.run()
    _print_outcome(summary, run_dir)
    finish_run(run_dir, summary, commit=commit or loaded.spec.run.track == "git")  # only ever warns
    _print_exported(run_dir)
    return summary


def _execute(loaded: Any, run_dir: Path, quiet: bool, commit: bool = False) -> int:
    return STATUS_EXIT.get(execute(loaded, run_dir, quiet, commit)["status"], EXIT_RUN_FAILED)


def shown_path(path: Path) -> str:
    """``path`` relative to the current directory when it lies under it, else absolute."""
    path, here = Path(path).resolve(), Path.cwd().resolve()
    return str(path.relative_to(here)) if path.is_relative_to(here) else str(path)


def _print_exported(run_dir: Path) -> None:
    """The last lines: where the run's exports are (each loads with ``opus.load(DIR)``)."""
    from opus.pipeline.run_files import export_dirs

    for path in export_dirs(run_dir):
        print(f"  exported  {shown_path(path)}")


def _preflight(loaded: Any, types: Any) -> None:
    from opus.pipeline.preflight import preflight

    preflight(loaded, types)


def _print_outcome(summary: dict[str, Any], run_dir: Path) -> None:
    from opus.pipeline.summary import headline

    print(f"{summary['status']}: {run_dir / 'summary.json'}")
    for reason in summary.get("reasons") or []:
        print(f"  why       {reason}")
    if summary.get("error") and summary["error"] not in " ".join(summary.get("reasons") or []):
        print(f"  {summary['error']}")
    for warning in summary.get("warnings") or []:
        print(f"  warning   {warning}")
    if headline(summary["baseline"]):  # a failed baseline measured nothing: no empty line
        print(f"  baseline  {headline(summary['baseline'])}")
    if summary["final_stage"]:
        intervals = summary.get("ratio_intervals") or {}

        def shown(key: str, value: float) -> str:
            if key not in intervals:
                return f"{key} ×{value:.3f}"
            span = intervals[key]
            noisy = ", noisy" if span["noisy"] else ""
            how = "bracketed" if span.get("method") == "bracketed" else "side by side"
            return f"{key} ×{value:.3f} [{span['low']:.3f}–{span['high']:.3f} {how}{noisy}]"

        ratios = "  ".join(shown(k, v) for k, v in summary["ratios"].items())
        print(f"  final     {headline(summary['final'])}   ({summary['final_stage']}; {ratios})")
    for rb in summary["rollbacks"]:
        print(f"  rollback  {rb['stage']} attempt {rb['attempt']}: {rb['reason']} → {rb['action']}")


def cmd_run(args: argparse.Namespace) -> int:
    from opus.pipeline.spec import load_pipeline

    loaded = load_pipeline(args.pipeline, [*args.overrides, *decisions_override(args.pipeline, args.decisions_from)])
    run_dir = args.run_dir or default_run_dir(loaded, args.runs_dir)
    return _execute(loaded, run_dir, args.quiet, args.commit)


def decisions_override(pipeline: Path, decisions_from: Path | None) -> list[str]:
    """``--decisions-from RUN_DIR`` as a ``--set``: the path relative to the pipeline file's directory (as
    a relative --set path is read), so pipeline.yaml keeps no absolute path; quoted as a YAML string."""
    import json

    from opus.atomic import relative_path

    if decisions_from is None:
        return []
    return [f"run.decisions_from={json.dumps(relative_path(decisions_from, Path(pipeline).parent))}"]


def default_run_dir(loaded: Any, runs_dir: Path) -> Path:
    return Path(runs_dir) / f"{loaded.spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def cmd_resume(args: argparse.Namespace) -> int:
    from opus.pipeline.run_files import load_run

    return _execute(load_run(args.run_dir), args.run_dir, args.quiet, args.commit)


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit 0 when a resume would redo nothing and the summary agrees, 3 otherwise."""
    from opus.pipeline.verify import verify_run

    plan, stale = verify_run(args.run_dir)
    for entry in plan:
        print(f"{entry['stage']:<20} {entry['action']:<10} {entry['why']}")
    for line in stale:
        print(f"warning: {line}")
    redo = [p["stage"] for p in plan if p["action"] != "reuse"]
    print(f"{args.run_dir}: " + (f"a resume would redo {', '.join(redo)}" if redo
                                 else "every checkpoint verifies; a resume would redo nothing"))
    return EXIT_OK if not redo and not stale else EXIT_RUN_FAILED


def cmd_check(args: argparse.Namespace) -> int:
    from opus.pipeline.graph import execution_order, validate
    from opus.pipeline.spec import load_pipeline

    loaded = load_pipeline(args.pipeline, args.overrides)
    graph, types = validate(loaded)
    _preflight(loaded, types)
    print(f"{args.pipeline}: valid; stages in order: {' → '.join(execution_order(graph))}")
    return EXIT_OK


def cmd_stages(args: argparse.Namespace) -> int:
    from opus.cli.stage_docs import reference_markdown, stage_markdown
    from opus.pipeline.registry import UnknownStageType, known_stage_types, load_stage_type

    if args.markdown:
        print(reference_markdown(), end="")
        return EXIT_OK
    if args.name:
        try:
            print(stage_markdown(args.name), end="")
        except UnknownStageType as exc:
            raise InputError(str(exc)) from None
        return EXIT_OK
    for name, target in sorted(known_stage_types().items()):
        doc = (load_stage_type(name).module.__doc__ or "").strip().splitlines()
        print(f"{name:<12} {target:<24} {doc[0] if doc else ''}")
    return EXIT_OK


COMMANDS = {"run": cmd_run, "resume": cmd_resume, "verify": cmd_verify, "check": cmd_check, "stages": cmd_stages}
