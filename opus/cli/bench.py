"""``opus bench PIPELINE_OR_RUN``: runtimes and formats side by side, in one process, timed in interleaved rounds.

opus.cli.main only registers this: ``add_parsers(sub)`` and ``COMMANDS``; torch and the contenders are
imported inside the command.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from opus.errors import EXIT_OK

CONTENDERS = ("fp32 (baseline), bf16, torch-int8, w8a16, w4a16, w8a8, w8a8-tensor, compile, hf, onnx-fp32, "
              "onnx-int8, llama-f16, llama-q8_0, llama-q4_0 (llama-gguf with --gguf), llama-plan (the run's plan as "
              "GGUF), opus")


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
    bench.add_argument("--out", type=Path, help="write bench.md, bench.json and bench.png here")
    bench.add_argument("--quiet", action="store_true")


def cmd_bench(args: argparse.Namespace) -> int:
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
