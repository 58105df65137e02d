"""``opus bench --serve RUN``: opus serve and llama.cpp's server under the same concurrent load, side by side.

Both servers run the run's final model (opus serve the run itself; llama-cpp-python's server the
run's GGUF: the export stage's ``gguf/model.gguf``, else the plan's GGUF written here as the
``llama-plan`` contender writes it), with the same thread count, and both stay up for the whole
sweep. Each level is measured in rounds, a round running it on both servers one right after the
other, the first alternating, so neither always meets the machine in the state the other left it;
a ratio is the median of the per-round ratios, with their range.
The prompts are the pipeline's text (distinct cuts of ``input_len`` tokens, decoded to text, the
same list in the same order for both), the output length fixed at ``output_len`` tokens.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opus.atomic import read_json
from opus.bench.core import Unavailable
from opus.bench.serve_servers import (
    find_llama_server,
    llama_server,
    llama_server_version,
    llamacpp_server,
    llamacpp_version,
    without_repacking,
)
from opus.bench.target import Target, resolve_target
from opus.errors import InputError, OpusError
from opus.runtime.machine import describe, recorded, thread_count
from opus.runtime.serve_load import (
    DEFAULT_LEVELS,
    Level,
    LevelResult,
    LevelRun,
    RequestResult,
    percentile,
    plan_levels,
    requests_per_level,
    run_level,
    summarize,
)
from opus.runtime.serve_prompts import pipeline_tokenizer, serve_prompts
from opus.runtime.server_process import READY_TIMEOUT_S, Server, ServerError, opus_server

METHOD = ("each level R rounds; a round runs the level on each server, one right after the other, the first "
          "server rotating from round to round; a level's pass on a server: one untimed wave of C short requests "
          "(warm-up), then C clients each sending streaming /v1/completions back to back (openai AsyncOpenAI, "
          "greedy, max_tokens = output length, end of sequence ignored) until the level's requests are sent, every "
          "request on a prompt of its own; TTFT: request sent → first token chunk; inter-token latency: gaps "
          "between token chunks, per token; TTFT and ITL percentiles over every request of every round; output "
          "tok/s: completion tokens of a pass / its wall time, the median of the rounds; a ratio is opus / "
          "llama.cpp, the median of the per-round ratios [min–max]")


NOISY_SPREAD = 0.15  # a ratio's [min, max] over the rounds wider than this share of its median is marked noisy
PROMPTS_COUNTED = 8  # prompts whose length is asked of a server that reports no usage


@dataclass
class ServeRequest:
    target: Path
    runs_dir: Path = Path("runs")
    input_len: int | None = None
    output_len: int | None = None
    levels: tuple[int, ...] = DEFAULT_LEVELS
    requests: int | None = None  # per level and round; default requests_per_level(concurrency)
    rounds: int = 3  # each level measured this many times on each server, alternating
    threads: int | None = None
    gguf: Path | None = None
    max_batch: int | None = None  # opus serve's; default the largest level
    kv_budget_mb: float | None = None
    eager: bool = False  # opus serve --eager: a quick start (no compiled decode steps), not what the run chose
    llama_server: Path | None = None  # llama.cpp's llama-server binary (default: found, opus.bench.serve_servers)
    ready_timeout_s: float = READY_TIMEOUT_S


def run_gguf(target: Target, given: Path | None, tokenizer: Any, work_dir: Path) -> tuple[Path, list[str]]:
    """The GGUF llama.cpp serves: ``--gguf``, else the run's export (``gguf/model.gguf`` of its last
    export stage), else the plan's GGUF of the run's final model written into ``work_dir``."""
    from opus.pipeline.run_files import EXPORT_RECORD, export_dirs

    if given is not None:
        if not given.is_file():
            raise InputError("no such GGUF file", file=str(given), key="--gguf")
        return given, [f"GGUF given: {given}"]
    assert target.run_dir is not None and target.checkpoint is not None
    for export_dir in reversed(export_dirs(target.run_dir)):
        record = read_json(export_dir / EXPORT_RECORD)
        gguf = ((record.get("info") or {}).get("targets") or {}).get("gguf") or {}
        if gguf.get("exported") and (export_dir / gguf["path"]).is_file():
            mix = ", ".join(f"{k} {v:.0%}" for k, v in (gguf.get("info") or {}).get("tensor_type_mix", {}).items())
            return export_dir / gguf["path"], [f"GGUF: the run's export {export_dir / gguf['path']} ({mix})"]
    from opus.bench.llamacpp import plan_gguf

    try:
        path, notes = plan_gguf(target.checkpoint, target.loaded.spec, target.loaded.base_dir,
                                target.loaded.spec.model.source(), tokenizer, work_dir / "llama-plan")
    except Unavailable as exc:
        raise OpusError(f"llama.cpp cannot serve this run: {exc}") from exc
    return path, ["the run has no exported GGUF: written here from its final model", *notes]


def _threads(request: ServeRequest, target: Target) -> int:
    if request.threads is not None:
        return request.threads
    if target.loaded.spec.run.threads:
        return thread_count(target.loaded.spec.run.threads)
    import torch

    return torch.get_num_threads()  # what opus bench and the stages default to: the physical cores


def run_serve_bench(request: ServeRequest, out: Path | None, display: Any) -> dict[str, Any]:
    """The sweep against both servers; the report (written by ``opus.bench.serve_output``)."""
    import importlib.util

    from opus.bench.llamacpp import INSTALL_HINT

    target = resolve_target(request.target, request.runs_dir)
    if target.run_dir is None or target.checkpoint is None:
        raise InputError(target.no_run_reason or "no finished run to serve", file=str(request.target))
    for module, hint in (("llama_cpp", INSTALL_HINT), ("openai", "pip install openai (the load generator's client)"),
                         ("sse_starlette", "pip install 'llama-cpp-python[server]' (its server's extras)")):
        if importlib.util.find_spec(module) is None:
            raise OpusError(f"opus bench --serve needs {module}: {hint}")
    spec = target.loaded.spec
    input_len, output_len = request.input_len or spec.workload.input_len, request.output_len or spec.workload.output_len
    threads = _threads(request, target)
    levels, prompt_count = plan_levels(request.levels, lambda c: request.requests or requests_per_level(c),
                                       request.rounds)
    tokenizer = pipeline_tokenizer(spec, target.loaded.base_dir, target.loaded.path)
    # Every request of the sweep its own prompt (the same one on both servers): none is a repeat a prefix
    # cache could answer from memory, where the text allows.
    prompts, prompt_source = serve_prompts(spec.data, target.loaded.base_dir, tokenizer, prompt_count, input_len)
    log_dir = out or target.run_dir / "serve-bench"
    report: dict[str, Any] = {
        "run": str(target.run_dir), "out": str(log_dir), "run_stage": target.stage, "input_len": input_len,
        "output_len": output_len, "levels": list(request.levels), "rounds": request.rounds,
        "requests": {str(lv.concurrency): lv.requests for lv in levels}, "threads": threads,
        "prompt_source": prompt_source, "method": METHOD}
    with tempfile.TemporaryDirectory(prefix="opus-serve-bench-") as tmp:
        gguf, gguf_notes = run_gguf(target, request.gguf, tokenizer, Path(tmp))
        # Room for one prompt and its output per request (llama-cpp-python's one context; each of
        # llama-server's slots): the prompt's text may tokenize a little longer in the GGUF's tokenizer.
        n_ctx = input_len + output_len + max(64, input_len // 4)
        binary = find_llama_server(request.llama_server)
        if binary is not None:  # llama.cpp's own server, one slot per client of the largest level
            llama = llama_server(binary, gguf, threads, n_ctx, max(request.levels), log_dir)
            llama.notes.append(f"{binary}: {llama_server_version(binary)}")
        else:
            llama = llamacpp_server(gguf, threads, n_ctx, log_dir)
            llama.notes += [f"llama-cpp-python {llamacpp_version()}", "llama-server not found (--llama-server PATH, "
                            "on the PATH, or `make llama-server`): llama-cpp-python's server, one request at a time"]
            display.line(llama.notes[-1])
        servers = [opus_server(target.run_dir, threads, log_dir, request.max_batch or max(request.levels),
                               request.kv_budget_mb, request.eager), llama]
        servers[1].notes += gguf_notes
        with recorded(machine := {}):
            try:
                for index, server in enumerate(servers):
                    display.line(f"starting {server.name} server: {server.notes[0]}")
                    try:
                        server.start(request.ready_timeout_s)
                    except ServerError:
                        again = without_repacking(server)
                        if again is None:
                            raise
                        display.line(again.notes[-1])
                        servers[index] = server = again.start(request.ready_timeout_s)
                    display.line(f"{server.name} ready on {server.url} (model '{server.model}')")
                    # What opus serve says it loaded (context, batch, KV blocks, compiled or eager decode steps).
                    said = [line for line in server.tail(40).splitlines() if line.startswith("loaded ")]
                    server.notes += said[:1]
                    counts = [n for n in (server.count_tokens(p) for p in prompts[:PROMPTS_COUNTED]) if n is not None]
                    if counts:  # a server whose stream has no usage: how long the prompts are in its tokenizer
                        server.notes.append(f"prompts in its tokenizer: median {percentile(counts, 50):.0f} tokens "
                                            f"(the first {len(counts)}; {input_len} in the pipeline's)")
                results, paired = interleave(servers, prompts, output_len, levels, request.rounds, display)
            finally:
                exit_codes = {server.name: server.stop() for server in servers}
    for server in servers:  # a server whose usage counted the prompts: how long they were in its tokenizer
        used = [level.prompt_tokens_p50 for level in results[server.name] if level and level.prompt_tokens_p50]
        if used:
            server.notes.append(f"prompts in its tokenizer: median {percentile(used, 50):.0f} tokens (its usage; "
                                f"{input_len} in the pipeline's)")
    report["servers"] = {s.name: {"notes": s.notes, "model": s.model, "log": str(s.log),
                                  "exit_code": exit_codes[s.name],
                                  "levels": [r.record() if r else None for r in results[s.name]]} for s in servers}
    report["ratios"] = paired
    machine["machine"]["threads"] = threads  # each server's threads, not this client process's
    report["machine"] = machine["machine"]
    report["environment"] = describe(machine["machine"])
    return report


def interleave(servers: list[Server], prompts: list[str], output_len: int, levels: list[Level], rounds: int,
               display: Any) -> tuple[dict[str, list[LevelResult | None]], list[dict[str, Any]]]:
    """Each level ``rounds`` times against every server, one after the other, the first server rotating
    from one round to the next (and on across levels). Per server and level the summary of its rounds;
    per level the order of each round, each round's figures and the paired ratios. A server that has
    died gets no more rounds, and the reason goes to the console with its log's tail."""
    results: dict[str, list[LevelResult | None]] = {s.name: [] for s in servers}
    paired: list[dict[str, Any]] = []
    display.start(float(sum(level.requests for level in levels) * rounds * len(servers)))
    done, what, turn, gone = [0], [""], 0, set()

    def on_done(result: RequestResult) -> None:
        done[0] += 1
        display.update(float(done[0]), what[0])

    for level in levels:
        runs: dict[str, dict[int, LevelRun]] = {s.name: {} for s in servers}
        orders = []
        for index in range(rounds):
            order = servers[turn % len(servers):] + servers[:turn % len(servers)]
            turn += 1
            orders.append([s.name for s in order])
            for server in order:
                if not server.alive():
                    if server.name not in gone:
                        gone.add(server.name)
                        code = server.process.poll() if server.process else None
                        display.line(f"{server.name} server is not running (exit {code}), its log:\n{server.tail()}")
                    done[0] += level.requests
                    continue
                what[0] = f"{server.name} c={level.concurrency} round {index + 1}/{rounds}"
                runs[server.name][index] = asyncio.run(run_level(
                    server.url, server.model, prompts, output_len, level.concurrency, level.requests,
                    server.extra_body, on_done, first_prompt=level.first(index)))
        for server in servers:
            measured = list(runs[server.name].values())
            summary = summarize(measured, level.concurrency, output_len) if measured else None
            results[server.name].append(summary)
            if summary is not None:
                display.line(level_line(server.name, summary))
        paired.append({"concurrency": level.concurrency, "orders": orders,
                       "rounds": {name: {str(i): {"output_tok_s": run.output_tok_s, "ttft_ms_p99": run.ttft_ms_p99}
                                         for i, run in by_round.items()} for name, by_round in runs.items()},
                       **paired_ratios(runs["opus"], runs["llama.cpp"])})
    return results, paired


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def level_line(name: str, level: LevelResult) -> str:
    errors = f", {level.errors} errors (first: {level.first_error})" if level.errors else ""
    short = f", {level.short} short" if level.short else ""
    return (f"{name:<9} c={level.concurrency:<3} {level.output_tok_s:8.1f} tok/s  {level.requests_s:6.2f} req/s  "
            f"TTFT p50/p99 {_ms(level.ttft_ms_p50)}/{_ms(level.ttft_ms_p99)} ms  ITL p50/p99 "
            f"{_ms(level.itl_ms_p50)}/{_ms(level.itl_ms_p99)} ms{errors}{short}")


def paired_ratios(opus: dict[int, LevelRun], llama: dict[int, LevelRun]) -> dict[str, Any]:
    """opus / llama.cpp from the rounds both ran (each round's two passes one right after the other): the
    median of the per-round ratios, their [min, max] and whether that is noisy; None where no round pairs
    up or a figure is missing (no token, no TTFT)."""
    out: dict[str, Any] = {"paired_rounds": 0}
    for key in ("output_tok_s", "ttft_ms_p99"):
        values = [getattr(opus[i], key) / getattr(llama[i], key) for i in sorted(opus.keys() & llama.keys())
                  if getattr(opus[i], key) is not None and getattr(llama[i], key)]
        out[key] = median = percentile(values, 50)
        out[f"{key}_range"] = [min(values), max(values)] if values else None
        # As opus bench marks its ratios: rounds that disagree by more than 15 % of the median say the machine
        # moved under the measurement; the figure stands, marked.
        out[f"{key}_noisy"] = bool(median and (max(values) - min(values)) / median > NOISY_SPREAD)
        out["paired_rounds"] = max(out["paired_rounds"], len(values))
    return out
