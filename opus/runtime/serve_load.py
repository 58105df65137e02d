"""A serving load generator: concurrent streaming clients against an OpenAI-compatible server.

At each concurrency level C, C clients each send streaming ``/v1/completions`` requests back to back
(the openai package's ``AsyncOpenAI``, a real HTTP client) until the level's request count is sent.
Per request: the time to its first token chunk, the gaps between its token chunks, the completion
tokens it got (the stream's ``usage`` when the server sends one, else its token chunks counted).
Per pass of a level (``LevelRun``): output tokens/s and requests/s over its wall time. Per level over
its passes (``summarize``; ``opus bench --serve`` runs each level in rounds): TTFT and inter-token
latency percentiles over every request, the median tok/s and req/s, and the errors (count and the
first one's text).

The client runs in this process and takes CPU of its own (parsing every streamed chunk), the same
for every server: on a machine with few cores, leave it one.

Output lengths are fixed: ``max_tokens`` is sent and each server is asked, its own way, not to stop
at end of sequence (``extra_body``); what arrived is counted, and a request that got fewer tokens
than asked is counted as short.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32)
REQUEST_TIMEOUT_S = 600.0


def requests_per_level(concurrency: int) -> int:
    """Enough requests that every client sends at least two, and a level has at least 8 samples."""
    return max(2 * concurrency, 8)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # per-token gaps between token chunks
    tokens: int = 0  # completion tokens received
    chunks: int = 0  # stream chunks that carried tokens
    counted_by: str = "chunks"  # "usage" when the stream ended with the server's usage
    prompt_tokens: int | None = None  # the prompt as the server tokenized it, when its usage says
    started: float = 0.0
    ended: float = 0.0


@dataclass
class LevelRun:
    """One pass of a level against one server: every request's result and the pass's wall time."""
    results: list[RequestResult]
    wall_s: float

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def output_tok_s(self) -> float:
        return sum(r.tokens for r in self.ok) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def ttft_ms_p99(self) -> float | None:
        return percentile([r.ttft_s * 1000 for r in self.ok if r.ttft_s is not None], 99)


@dataclass
class LevelResult:
    """A level against one server over its rounds: counts summed, latency percentiles over every request
    of every round, output tok/s and req/s the median of the rounds' (with their range)."""
    concurrency: int
    rounds: int
    requests: int
    ok: int
    errors: int
    first_error: str | None
    short: int  # requests that completed with fewer tokens than max_tokens
    wall_s: float  # all rounds together
    output_tokens: int
    tokens_counted_by: str  # "usage", "chunks" or "chunks+usage" (mixed)
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    itl_ms_p50: float | None
    itl_ms_p99: float | None
    prompt_tokens_p50: float | None  # from the server's usage; None when it sends none
    output_tok_s: float
    output_tok_s_range: tuple[float, float]
    requests_s: float

    def record(self) -> dict[str, Any]:
        return asdict(self)


def _token_chunk(chunk: Any) -> bool:
    """A chunk that carries generated text. A server may end with an empty chunk holding only the
    finish reason, or with a usage-only chunk (no choices): those carry no token."""
    if not chunk.choices:
        return False
    choice = chunk.choices[0]
    return bool(choice.text) or choice.finish_reason is None


def _itl(times: list[float], tokens: int) -> list[float]:
    """Per-token gaps: each gap between token chunks, divided by the tokens a chunk carries on average
    (a server may send several tokens in one chunk, e.g. an incomplete UTF-8 character held back)."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    if not gaps:
        return []
    per_chunk = max(1.0, (tokens - 1) / len(gaps))
    return [gap / per_chunk for gap in gaps]


async def one_request(client: Any, model: str, prompt: str, max_tokens: int,
                      extra_body: dict[str, Any] | None) -> RequestResult:
    """One streaming completion, timed from just before the request is sent. Greedy (temperature 0),
    so both servers do the same work for the same prompt."""
    started = time.perf_counter()
    times: list[float] = []
    usage_tokens = prompt_tokens = None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra_body or None)
        async for chunk in stream:
            now = time.perf_counter()
            if getattr(chunk, "usage", None) is not None and chunk.usage.completion_tokens is not None:
                usage_tokens, prompt_tokens = int(chunk.usage.completion_tokens), chunk.usage.prompt_tokens
            if _token_chunk(chunk):
                times.append(now)
    except Exception as exc:  # noqa: BLE001 - any failure of a request is that request's error, counted
        text = " ".join(str(exc).split()) or "no message"
        return RequestResult(False, f"{type(exc).__name__}: {text}"[:300], started=started,
                             ended=time.perf_counter())
    ended = time.perf_counter()
    tokens = usage_tokens if usage_tokens is not None else len(times)
    if not times:
        return RequestResult(False, "the stream ended without a token", started=started, ended=ended)
    return RequestResult(True, None, times[0] - started, _itl(times, tokens), tokens, len(times),
                         "usage" if usage_tokens is not None else "chunks", prompt_tokens, started, ended)


def make_client(base_url: str, timeout_s: float = REQUEST_TIMEOUT_S) -> Any:
    """An AsyncOpenAI client of ``base_url`` (the server root; ``/v1`` is added). No retries: a failed
    request is an error of the level, not a hidden second attempt."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="opus-bench", max_retries=0,
                       timeout=timeout_s)


@dataclass(frozen=True)
class Level:
    concurrency: int
    requests: int  # per round
    first_prompt: int  # round r takes the prompts from first(r) on: its requests, then its warm-up wave
    prompts_per_round: int

    def first(self, round_index: int) -> int:
        return self.first_prompt + round_index * self.prompts_per_round


def plan_levels(levels: Sequence[int], requests: Callable[[int], int] = requests_per_level, rounds: int = 1,
                warmup: bool = True) -> tuple[list[Level], int]:
    """The levels of a sweep, each round of each level on the prompts after the previous one's (its
    requests, then its warm-up wave), and how many prompts the sweep takes in all."""
    planned, first = [], 0
    for concurrency in levels:
        count = requests(concurrency)
        per_round = count + (concurrency if warmup else 0)
        planned.append(Level(concurrency, count, first, per_round))
        first += rounds * per_round
    return planned, first


async def run_level(base_url: str, model: str, prompts: Sequence[str], max_tokens: int, concurrency: int,
                    requests: int, extra_body: dict[str, Any] | None = None,
                    on_done: Callable[[RequestResult], None] | None = None,
                    warmup: bool = True, first_prompt: int = 0) -> LevelRun:
    """``requests`` requests from ``concurrency`` clients, each sending back to back; request i gets
    prompt ``first_prompt + i`` (mod len(prompts)), so every server sees the same prompts in the same
    order, and a sweep that gives each level its own prompts never repeats one (a prefix cache would
    answer a repeat from memory).

    With ``warmup``, one untimed wave of ``concurrency`` short requests first (on the prompts after the
    timed ones): a server that builds something per batch size (a compiled graph) does so before the
    clock starts."""
    if not prompts:
        raise ValueError("no prompts")
    client = make_client(base_url)

    def prompt(index: int) -> str:
        return prompts[(first_prompt + index) % len(prompts)]

    try:
        if warmup:
            await asyncio.gather(*(one_request(client, model, prompt(requests + i), min(max_tokens, 4), extra_body)
                                   for i in range(concurrency)))
        queue = list(range(requests))
        results: list[RequestResult] = []

        async def worker() -> None:
            while queue:
                index = queue.pop(0)
                result = await one_request(client, model, prompt(index), max_tokens, extra_body)
                results.append(result)
                if on_done is not None:
                    on_done(result)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, requests))))
        wall = time.perf_counter() - start
    finally:
        await client.close()
    return LevelRun(results, wall)


def summarize(runs: list[LevelRun], concurrency: int, max_tokens: int) -> LevelResult:
    results = [r for run in runs for r in run.results]
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    itl = [gap * 1000 for r in ok for gap in r.itl_s]
    rates = [run.output_tok_s for run in runs]
    return LevelResult(
        concurrency=concurrency, rounds=len(runs), requests=len(results), ok=len(ok), errors=len(failed),
        first_error=failed[0].error if failed else None, short=sum(r.tokens < max_tokens for r in ok),
        wall_s=sum(run.wall_s for run in runs), output_tokens=sum(r.tokens for r in ok),
        tokens_counted_by="+".join(sorted({r.counted_by for r in ok})) or "none",
        ttft_ms_p50=percentile(ttft, 50), ttft_ms_p99=percentile(ttft, 99),
        itl_ms_p50=percentile(itl, 50), itl_ms_p99=percentile(itl, 99),
        prompt_tokens_p50=percentile([r.prompt_tokens for r in ok if r.prompt_tokens is not None], 50),
        output_tok_s=percentile(rates, 50) or 0.0,
        output_tok_s_range=(min(rates, default=0.0), max(rates, default=0.0)),
        requests_s=percentile([len(run.ok) / run.wall_s if run.wall_s > 0 else 0.0 for run in runs], 50) or 0.0)


def sweep(base_url: str, model: str, prompts: Sequence[str], max_tokens: int,
          levels: Sequence[int] = DEFAULT_LEVELS, extra_body: dict[str, Any] | None = None,
          requests: Callable[[int], int] = requests_per_level,
          on_done: Callable[[RequestResult], None] | None = None) -> list[LevelResult]:
    """Every level once, in turn, against one server (``opus bench --serve`` alternates two servers)."""
    results = []
    for level in plan_levels(levels, requests)[0]:
        run = asyncio.run(run_level(base_url, model, prompts, max_tokens, level.concurrency, level.requests,
                                    extra_body, on_done, first_prompt=level.first(0)))
        results.append(summarize([run], level.concurrency, max_tokens))
    return results
