"""``opus bench PIPELINE_OR_RUN``: runtimes and formats side by side, in one process, timed in interleaved rounds.
``opus bench --serve RUN``: opus serve and llama.cpp's server under the same concurrent load (opus.bench.serve_run).

opus.cli.main only registers this: ``add_parsers(sub)`` and ``COMMANDS``; torch and the contenders are
imported inside the command.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from opus.errors import EXIT_OK, InputError
from opus.runtime.serve_load import DEFAULT_LEVELS  # standard library only at import: the CLI stays quick

# Options of the contender bench that mean nothing to the serving sweep: refused with --serve.
NOT_SERVE = {"only": "--only", "batch_size": "--batch", "warmup": "--warmup", "repeats": "--repeats",
             "eval_samples": "--eval-samples", "eval_len": "--eval-len", "budget": "--budget",
             "converter": "--converter"}

CONTENDERS = ("fp32 (baseline), bf16, torch-int8, w8a16, w4a16, w8a8, w8a8-tensor, compile, hf, onnx-fp32, "
              "onnx-int8, ov, ov-int8, ov-fp32, llama-f16, llama-q8_0, llama-q4_0 (with --gguf or a GGUF model: "
              "llama-gguf, and llama-q8_0 and llama-q4_k_m made of it by llama.cpp's quantizer), "
              "llama-plan (the run's plan as GGUF), opus")


def add_parsers(sub: Any) -> None:
    bench = sub.add_parser(
        "bench", help="compare runtimes and formats side by side: P, D, decode, memory, perplexity, agreement",
        description=f"Contenders: {CONTENDERS}. Ratios are against the fp32 baseline, timed in the same interleaved "
                    "rounds (every contender once per round, in rotated order).")
    bench.add_argument("target", type=Path, help="a pipeline file (its latest finished run is the 'opus' "
                                                 "contender) or a run directory")
    bench.add_argument("--only", help="comma list of contenders, prefixes (llama, onnx) or families (torch); "
                                      "the fp32 baseline always runs")
    bench.add_argument("--batch", dest="batch_size", type=int, help="P batch (default: the pipeline's workload)")
    bench.add_argument("--input-len", type=int)
    bench.add_argument("--output-len", type=int)
    bench.add_argument("--warmup", type=int)
    bench.add_argument("--repeats", type=int)
    bench.add_argument("--eval-samples", type=int, help="evaluation blocks (default: data.evaluation.samples)")
    bench.add_argument("--eval-len", type=int, help="tokens per evaluation block (default: data.evaluation.seq_len)")
    bench.add_argument("--budget", type=float, help="max relative perplexity increase, e.g. 0.01 = +1 %% "
                                                    "(default: the eval stage's perplexity gate, else 0.01)")
    bench.add_argument("--threads", type=int, help="threads for torch, onnxruntime and llama.cpp")
    bench.add_argument("--gguf", type=Path, help="run llama.cpp on this GGUF instead of converting the model")
    bench.add_argument("--converter", type=Path, help="llama.cpp's convert_hf_to_gguf.py, a llama.cpp source "
                                                      "directory or a llama-cpp-python sdist (.tar.gz)")
    bench.add_argument("--group-size", type=int, default=64, help="w4a16 group size (default 64)")
    bench.add_argument("--runs-dir", type=Path, default=Path("runs"))
    bench.add_argument("--format", choices=("md", "json"), default="md", help="what is printed (default md)")
    bench.add_argument("--out", type=Path, help="write bench.md, bench.json and bench.png here (with --serve: "
                                                "serve.md, serve.json, serve.png and the servers' logs; default "
                                                "RUN/serve-bench)")
    bench.add_argument("--quiet", action="store_true")
    serve = bench.add_argument_group(
        "serving (--serve)", "opus serve and llama.cpp's server (llama-cpp-python[server]) on the run's model, "
        "a concurrency sweep of streaming clients against each, side by side; --input-len, --output-len, --threads, "
        "--gguf, --out and --format apply too")
    serve.add_argument("--serve", action="store_true", help="benchmark serving instead of the contenders")
    serve.add_argument("--concurrency", default=",".join(map(str, DEFAULT_LEVELS)),
                       help=f"concurrent clients per level (default {','.join(map(str, DEFAULT_LEVELS))})")
    serve.add_argument("--requests", type=int, help="requests per level and round (default max(2 × clients, 8))")
    serve.add_argument("--rounds", type=int, default=3, help="rounds per level, each on both servers (default 3)")
    serve.add_argument("--max-batch", type=int, help="opus serve's --max-batch (default: the most clients)")
    serve.add_argument("--kv-budget-mb", type=float, help="opus serve's --kv-budget-mb (default: the run's)")
    serve.add_argument("--eager", action="store_true", help="opus serve's decode steps eager, not compiled: a quick "
                                                             "start for a check, not what the run chose")
    serve.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary (default: on the PATH, "
                                                         "else the one `make llama-server` builds; none: "
                                                         "llama-cpp-python's server, one request at a time)")
    serve.add_argument("--ready-timeout", type=float, default=900.0,
                       help="seconds a server may take to start (default 900: opus serve compiles a decode step "
                            "per batch bucket first, on a 30-layer model about a minute each)")


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise InputError(f"'{text}' is not a comma list of positive client counts, e.g. 1,2,4,8", key="--concurrency")
    return levels


def _positive(args: argparse.Namespace, names: dict[str, str]) -> None:
    for attr, flag in names.items():
        value = getattr(args, attr)
        if value is not None and value <= 0:
            raise InputError(f"must be positive, got {value:g}", key=flag)


def cmd_serve_bench(args: argparse.Namespace) -> int:
    from opus.bench.display import BenchDisplay
    from opus.bench.serve_output import emit
    from opus.bench.serve_run import ServeRequest, run_serve_bench

    given = [flag for attr, flag in NOT_SERVE.items() if getattr(args, attr) is not None]
    if given:
        raise InputError("does not apply to the serving sweep", key=given[0])
    _positive(args, {"input_len": "--input-len", "output_len": "--output-len", "threads": "--threads",
                     "requests": "--requests", "rounds": "--rounds", "max_batch": "--max-batch",
                     "kv_budget_mb": "--kv-budget-mb", "ready_timeout": "--ready-timeout"})
    request = ServeRequest(target=args.target, runs_dir=args.runs_dir, input_len=args.input_len,
                           output_len=args.output_len, levels=_levels(args.concurrency), requests=args.requests,
                           rounds=args.rounds, threads=args.threads, gguf=args.gguf, max_batch=args.max_batch,
                           kv_budget_mb=args.kv_budget_mb, eager=args.eager, ready_timeout_s=args.ready_timeout,
                           llama_server=args.llama_server)
    with BenchDisplay(quiet=args.quiet) as display:
        report = run_serve_bench(request, args.out, display)
    emit(report, args.format, Path(report["out"]))
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    if args.serve:
        return cmd_serve_bench(args)
    from opus.bench.display import BenchDisplay
    from opus.bench.output import emit
    from opus.bench.run import BenchRequest, run_bench

    only = [t.strip() for t in args.only.split(",") if t.strip()] if args.only else None
    request = BenchRequest(target=args.target, runs_dir=args.runs_dir, only=only, batch_size=args.batch_size,
                           input_len=args.input_len, output_len=args.output_len, warmup=args.warmup,
                           repeats=args.repeats, eval_samples=args.eval_samples, eval_len=args.eval_len,
                           budget=args.budget, threads=args.threads, gguf=args.gguf, converter=args.converter,
                           group_size=args.group_size)
    with BenchDisplay(quiet=args.quiet) as display:
        report, rows = run_bench(request, display)
    emit(report, rows, args.format, args.out)
    return EXIT_OK


COMMANDS = {"bench": cmd_bench}
