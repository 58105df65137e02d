"""``opus lm-eval``: lm-evaluation-harness's own command line with Opus's model class ``opus``; ``opus tasks``.

The harness finds model classes only among its own (it has no plugin entry point), so ``opus lm-eval``
registers ``opus`` and hands every argument to the harness's command line unchanged: ``opus lm-eval
--model opus --model_args path=runs/night --tasks hellaswag --limit 200`` is ``lm_eval`` as its users run
it. One addition: a task file passed by path (``--tasks examples/k3/tasks/k3_next_line.yaml``, or a folder
of them) has its relative ``data_files`` resolved against its own folder, so it runs from any directory.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from opus.errors import EXIT_OK, InputError


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("lm-eval", help="lm-evaluation-harness with the model class 'opus' (--model opus "
                                       "--model_args path=RUN_OR_EXPORT --tasks ...)", add_help=False)
    p.add_argument("harness_args", nargs=argparse.REMAINDER, help="the harness's own arguments (lm_eval -h)")
    p = sub.add_parser("tasks", help="write harness task files from text: which line comes next, finish the line")
    p.add_argument("files", nargs="+", type=Path, help="text files (source code or prose)")
    p.add_argument("--out", type=Path, required=True, help="folder for the task files")
    p.add_argument("--name", required=True, help="task name prefix: NAME_next_line, NAME_word_order, NAME_line_end")
    p.add_argument("--samples", type=int, default=100, help="items per task (default 100)")
    p.add_argument("--seed", type=int, default=0)


def _resolve_task_files(value: str, folder: Path) -> str:
    """``--tasks`` with every task file (or folder of them) given by path replaced by a resolved copy."""
    import yaml

    from opus.atomic import write_text
    from opus.harness.tasks import task_entry

    out = []
    for item in value.split(","):
        path = Path(item)
        files = sorted(path.glob("*.yaml")) if path.is_dir() else [path] if item.endswith((".yaml", ".yml")) else []
        if not files:
            out.append(item)
            continue
        for file in files:
            config = task_entry(str(file.resolve()), Path.cwd())
            copy = folder / f"{config['task']}.yaml"
            write_text(copy, yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
            out.append(str(copy))
    return ",".join(out)


def harness_argv(args: list[str], folder: Path) -> list[str]:
    argv = list(args)
    for index, arg in enumerate(argv):
        if arg == "--tasks" and index + 1 < len(argv):
            argv[index + 1] = _resolve_task_files(argv[index + 1], folder)
        elif arg.startswith("--tasks="):
            argv[index] = "--tasks=" + _resolve_task_files(arg.removeprefix("--tasks="), folder)
    return argv


def cmd_lm_eval(args: argparse.Namespace) -> int:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        raise InputError("opus lm-eval runs lm-evaluation-harness: pip install 'opus[lmeval]'") from None
    import opus.harness.lm  # noqa: F401  (registers the model class 'opus')

    with tempfile.TemporaryDirectory(prefix="opus-tasks-") as folder:
        sys.argv = ["lm_eval", *harness_argv(args.harness_args, Path(folder))]
        try:
            cli_evaluate()
        except SystemExit as stop:  # argparse's errors and --help: the harness's own exit code
            return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 2)
    return EXIT_OK


def cmd_tasks(args: argparse.Namespace) -> int:
    from opus.harness.tasks import write_tasks

    if args.samples < 1:
        raise InputError(f"must be at least 1, got {args.samples}", key="--samples")
    missing = [str(f) for f in args.files if not f.is_file()]
    if missing:
        raise InputError(f"no such text file: {', '.join(missing[:3])}")
    for path in write_tasks(list(args.files), args.out, args.name, args.samples, args.seed):
        print(path)
    return EXIT_OK


COMMANDS = {"lm-eval": cmd_lm_eval, "tasks": cmd_tasks}
