"""``opus`` command line: the parser and dispatch; each command group is one module of ``opus.cli``.

Exit codes: 0 finished, 2 invalid input, 3 failed, 4 degraded, 130 stopped.
"""

from __future__ import annotations

import argparse
import signal
import sys
from types import ModuleType

from opus.errors import EXIT_INTERRUPTED, EXIT_OK, OpusError


def _groups() -> list[ModuleType]:
    """The command groups, each with ``add_parsers(sub)`` and ``COMMANDS`` (imported lazily: torch and the
    bench contenders load only for the commands that need them)."""
    from opus.cli import bench, doctor, harness, history, inspect, run, serve

    return [run, inspect, doctor, history, bench, serve, harness]


def _parser(groups: list[ModuleType]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opus", description="Overnight optimizer for PyTorch LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in groups:
        group.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    groups = _groups()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:  # every argument is the harness's own: argparse would claim its options
        args = argparse.Namespace(command="lm-eval", harness_args=argv[1:])
    else:
        args = _parser(groups).parse_args(argv)
    # SIGTERM (a scheduler, a shutdown) stops as cleanly as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    commands = {name: fn for group in groups for name, fn in group.COMMANDS.items()}
    try:
        return commands[args.command](args)
    except OpusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
