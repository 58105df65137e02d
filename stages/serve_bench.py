"""``serve_bench``: the incoming model behind ``opus serve``, measured the way serving is measured.

The stage starts ``opus serve`` on its incoming checkpoint (a server process of its own, the run's KV
cache choice and compiled decode steps, as a user would start it), then runs a concurrency sweep of
streaming clients (``opus.runtime.serve_load``: real HTTP clients) on prompts cut from the pipeline's
evaluation text, and stops the server (SIGTERM: it drains and exits 0, or the stage fails).

Metrics (at the highest concurrency; every level in ``serve_bench.json``): ``serve_output_tok_s``,
``serve_ttft_p50_ms``, ``serve_ttft_p99_ms``, ``serve_itl_p50_ms``, ``serve_itl_p99_ms``,
``serve_errors`` and ``serve_short`` (requests that failed or came back short, over every level),
``serve_concurrency``; ``serve_output_tok_s_c1`` (one client). A gate such as
``serve_ttft_p99_ms: {max: 500}`` or ``serve_errors: {max: 0}`` makes serving part of the run's verdict.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from opus.errors import InputError
from opus.pipeline.context import StageContext, StageResult

VERSION = "1"
ROLE = "measure"
SERVE_BENCH_FILE = "serve_bench.json"
METRICS = frozenset({"serve_output_tok_s", "serve_ttft_p50_ms", "serve_ttft_p99_ms", "serve_itl_p50_ms",
                     "serve_itl_p99_ms", "serve_errors", "serve_short", "serve_concurrency", "serve_output_tok_s_c1"})


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")
    concurrency: list[int] = Field([1, 2, 4, 8], min_length=1, description="clients at once, level by level")
    requests: int | None = Field(None, gt=0, description="requests per level (default max(2 × clients, 8))")
    input_len: int | None = Field(None, gt=0, description="prompt tokens (default: workload.input_len)")
    output_len: int | None = Field(None, gt=0, description="tokens per answer (default: workload.output_len)")
    threads: int | None = Field(None, gt=0, description="the server's torch threads (default: run.threads, else "
                                                        "torch's)")
    max_batch: int | None = Field(None, gt=0, description="the server's batch limit (default: the most clients)")
    eager: bool = Field(False, description="eager decode steps instead of what the run chose (a quick start)")
    ready_timeout_s: float = Field(900, gt=0, description="for loading and compiling before the first request")


def run(ctx: StageContext, cfg: Config) -> StageResult:
    from opus.runtime.machine import thread_count
    from opus.runtime.serve_load import plan_levels, requests_per_level, run_level, summarize
    from opus.runtime.serve_prompts import pipeline_tokenizer, serve_prompts
    from opus.runtime.server_process import opus_server

    if any(c < 1 for c in cfg.concurrency):
        raise InputError(f"concurrency: every level needs at least 1 client, got {cfg.concurrency}")
    if ctx.incoming is None:
        raise InputError("serve_bench needs a model state: put it after a stage that keeps one")
    spec, wl = ctx.spec, ctx.workload
    input_len, output_len = cfg.input_len or wl.input_len, cfg.output_len or wl.output_len
    threads = cfg.threads or thread_count(spec.run.threads) or _torch_threads()
    levels, count = plan_levels(cfg.concurrency, lambda c: cfg.requests or requests_per_level(c))
    tokenizer = pipeline_tokenizer(spec, ctx.base_dir, ctx.run_dir)
    prompts, prompt_source = serve_prompts(spec.data, ctx.base_dir, tokenizer, count, input_len)
    server = opus_server(ctx.incoming, threads, ctx.artifact_dir, cfg.max_batch or max(cfg.concurrency),
                         eager=cfg.eager)
    total, done = float(sum(level.requests for level in levels)), [0]

    def on_done(_result: Any) -> None:
        done[0] += 1
        ctx.progress(done[0], total, "requests")

    ctx.log(f"serve_bench: starting {server.notes[0]}")
    results = []
    try:
        server.start(cfg.ready_timeout_s)
        loaded = [line for line in server.tail(40).splitlines() if line.startswith("loaded ")]
        ctx.log(f"serve_bench: {loaded[0] if loaded else 'server ready'}")
        for level in levels:
            run_once = asyncio.run(run_level(server.url, server.model, prompts, output_len, level.concurrency,
                                             level.requests, server.extra_body, on_done, first_prompt=level.first(0)))
            result = summarize([run_once], level.concurrency, output_len)
            results.append(result)
            ctx.log(f"serve_bench: {level.concurrency} clients: {result.output_tok_s:.1f} tok/s, TTFT p99 "
                    f"{_ms(result.ttft_ms_p99)}, ITL p99 {_ms(result.itl_ms_p99)}, {result.errors} errors")
    finally:
        exit_code = server.stop()
    if exit_code != 0:
        raise RuntimeError(f"opus serve exited with code {exit_code} when stopped; its log:\n{server.tail()}")
    top, one = results[-1], next((r for r in results if r.concurrency == 1), None)
    metrics: dict[str, Any] = {
        "serve_output_tok_s": top.output_tok_s, "serve_ttft_p50_ms": top.ttft_ms_p50,
        "serve_ttft_p99_ms": top.ttft_ms_p99, "serve_itl_p50_ms": top.itl_ms_p50, "serve_itl_p99_ms": top.itl_ms_p99,
        "serve_errors": sum(r.errors for r in results), "serve_short": sum(r.short for r in results),
        "serve_concurrency": top.concurrency}
    if one is not None:
        metrics["serve_output_tok_s_c1"] = one.output_tok_s
    ctx.write_artifact(SERVE_BENCH_FILE, {
        "server": server.notes + loaded[:1], "threads": threads, "input_len": input_len, "output_len": output_len,
        "prompt_source": prompt_source, "levels": [r.record() for r in results]})
    return StageResult(metrics={k: v for k, v in metrics.items() if v is not None}, model=None,
                       info={"serve": f"{top.concurrency} clients: {top.output_tok_s:.1f} tok/s, "
                                      f"TTFT p99 {_ms(top.ttft_ms_p99)}"})


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f} ms"
