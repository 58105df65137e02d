"""Continuous batching: one thread owns the model and runs every request through one loop.

Each step (``Engine.step``): requests that were cancelled or finished free their blocks; waiting
requests are admitted while KV blocks and batch rows are free; then the step's token budget
(``step_tokens``, as vLLM's ``max_num_batched_tokens``) is spent: one token for each request past its
prompt (decode first, so a running request never waits behind a long prompt), the rest on prompt chunks
of the requests still prefilling, first come first served, at most ``prefill_chunk`` tokens of one
request per step. Chunks of equal length run as one batched forward; then one batched decode step runs
for every request past its prompt, padded to a batch bucket (1, 2, 4, ... up to ``max_batch``) so the
compiled graph of that bucket serves it (``opus.serve.steps``). Tokens go back through each request's
``emit`` callback from the engine thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from opus.runtime.engine import Sampling, select_next
from opus.serve.blocks import Allocation, BlockManager, OutOfBlocks
from opus.serve.kv_blocks import SCRATCH_BLOCK, KVBlockPool, PagedView, slots_of
from opus.serve.steps import DecodeSteps

# (token or None, finish reason or None): a token, then one call with the reason when the request ends.
Emit = Callable[[int | None, str | None], None]


class QueueFull(RuntimeError):
    """The waiting queue is at its limit: the client should retry later (HTTP 429)."""


class TooLong(ValueError):
    """A request that could never fit: beyond the model's context or the whole KV pool (HTTP 400)."""


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_tokens: int
    emit: Emit
    sampling: Sampling | None = None
    stop_ids: frozenset[int] = frozenset()
    arrival: float = field(default_factory=time.perf_counter)
    allocation: Allocation | None = None
    computed: int = 0  # positions whose K/V are in the cache
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    finish_reason: str | None = None
    last_token_at: float | None = None
    generator: torch.Generator | None = None

    @property
    def prefilled(self) -> bool:
        return self.computed >= len(self.prompt)


@dataclass
class Stats:
    """What the engine has done, for /metrics (read by the server thread; plain ints and floats)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0


class Engine:
    def __init__(self, model: nn.Module, pool: KVBlockPool, blocks: BlockManager, *, max_batch: int,
                 max_waiting: int, max_context: int, prefill_chunk: int = 512, step_tokens: int = 512,
                 compile_decode: bool = True) -> None:
        if step_tokens <= max_batch:
            raise ValueError(f"step_tokens ({step_tokens}) must exceed max_batch ({max_batch}): a full batch's "
                             "decode step would leave no token for any prompt")
        self.model, self.pool, self.blocks = model, pool, blocks
        self.max_batch, self.max_waiting, self.max_context = max_batch, max_waiting, max_context
        self.prefill_chunk, self.step_tokens = prefill_chunk, step_tokens
        self.steps = DecodeSteps(model, pool, max_batch, compile_decode)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = Stats()
        # ("ttft" | "itl", seconds) for each token handed out: the server's latency histograms.
        self.observe: Callable[[str, float], None] = lambda _name, _seconds: None
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # -- the server's side --------------------------------------------------------------------------
    def check(self, prompt_len: int, max_tokens: int) -> None:
        """TooLong when a request of these lengths could never run here."""
        total = prompt_len + max_tokens
        if total > self.max_context:
            raise TooLong(f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}: {total} "
                          f"exceeds the context of {self.max_context} tokens")
        if self.blocks.blocks_for(total) > self.blocks.usable:
            raise TooLong(f"{total} tokens need {self.blocks.blocks_for(total)} KV blocks; the pool has "
                          f"{self.blocks.usable} (raise --kv-budget-mb)")

    def submit(self, request: Request) -> None:
        self.check(len(request.prompt), request.max_tokens)
        with self._wake:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already (limit {self.max_waiting})")
            if request.sampling is not None:
                request.generator = torch.Generator().manual_seed(request.sampling.seed)
            self.waiting.append(request)
            self._wake.notify()

    def cancel(self, request: Request) -> None:
        with self._wake:
            request.cancelled = True
            self._wake.notify()

    def start(self, threads: int | None = None) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, args=(threads,), name="opus-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Finish what is running and waiting, then end the loop."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the engine thread ----------------------------------------------------------------------------
    def _loop(self, threads: int | None) -> None:
        if threads:
            torch.set_num_threads(threads)
        try:
            with torch.inference_mode():
                while True:
                    with self._wake:
                        while not (self.waiting or self.running or self._stopping):
                            self._wake.wait()
                        if self._stopping and not (self.waiting or self.running):
                            return
                    self.step()
        except BaseException as exc:  # noqa: BLE001 - the server reports it on /health and to every request
            self.error = exc
            for request in [*self.running, *self.waiting]:
                request.emit(None, "error")

    def step(self) -> None:
        self._reap()
        self._admit()
        ready = [r for r in self.running if r.prefilled]
        self._prefill(self._prompt_chunks(self.step_tokens - min(len(ready), self.max_batch)))
        ready = [r for r in self.running if r.prefilled and r.finish_reason is None and not r.cancelled]
        for start in range(0, len(ready), self.max_batch):
            self._decode(ready[start:start + self.max_batch])
        self._reap()

    def _prompt_chunks(self, budget: int) -> list[tuple[Request, int, int]]:
        """(request, start, end) prompt chunks for this step: first come first served within ``budget``."""
        chunks = []
        for request in self.running:
            if budget <= 0:
                break
            if not request.prefilled:
                end = min(len(request.prompt), request.computed + self.prefill_chunk, request.computed + budget)
                chunks.append((request, request.computed, end))
                budget -= end - request.computed
        return chunks

    def _reap(self) -> None:
        with self._wake:
            for request in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(request)
                request.emit(None, "cancelled")
        for request in [r for r in self.running if r.cancelled or r.finish_reason is not None]:
            self.running.remove(request)
            if request.allocation is not None:
                self.blocks.release(request.allocation)
            if request.finish_reason is None:
                request.emit(None, "cancelled")

    def _admit(self) -> None:
        with self._wake:
            while self.waiting and len(self.running) < self.max_batch:
                request = self.waiting[0]
                try:
                    request.allocation = self.blocks.allocate(request.prompt, len(request.prompt) + request.max_tokens)
                except OutOfBlocks:
                    return  # first come, first served: the head of the queue waits for blocks
                self.waiting.popleft()
                request.computed = request.allocation.cached_tokens
                self.running.append(request)
                self.stats.prompt_tokens += len(request.prompt)

    def _prefill(self, chunks: list[tuple[Request, int, int]]) -> None:
        """Each group of equally long chunks as one forward; a request whose prompt is done gets its first token."""
        by_length: dict[int, list[tuple[Request, int, int]]] = {}
        for chunk in chunks:
            by_length.setdefault(chunk[2] - chunk[1], []).append(chunk)
        size = self.blocks.block_size
        for group in by_length.values():
            keys = max(end for _, _, end in group)
            write, read, positions, ids = [], [], [], []
            for request, start, end in group:
                assert request.allocation is not None
                blocks = request.allocation.blocks
                write += slots_of(blocks, start, end, size)
                # Rows read keys up to the longest row's end; the scratch block pads the shorter ones (masked:
                # a padded key sits beyond every position of its row).
                read.append(slots_of(blocks, 0, end, size) + [SCRATCH_BLOCK * size] * (keys - end))
                positions.append(list(range(start, end)))
                ids.append(request.prompt[start:end])
            view = PagedView(self.pool.k, self.pool.v, torch.tensor(positions), torch.tensor(write),
                             torch.tensor(read))
            logits = self.model(torch.tensor(ids), cache=view, last_only=True)
            for row, (request, _start, end) in enumerate(group):
                request.computed = end
                if request.prefilled:
                    self.blocks.publish(request.allocation, request.prompt)
                    self._accept(request, logits[row:row + 1, -1])

    def _decode(self, batch: list[Request]) -> None:
        tokens = [r.generated[-1] for r in batch]
        positions = [r.computed for r in batch]
        tables = [r.allocation.blocks if r.allocation else [] for r in batch]
        logits = self.steps.run(tokens, positions, tables, self.blocks.block_size)
        for row, request in enumerate(batch):
            request.computed += 1
            self._accept(request, logits[row:row + 1])

    def _accept(self, request: Request, logits: torch.Tensor) -> None:
        """Sample the next token from ``logits`` [1, V], hand it out, and end the request if it is done."""
        token = int(select_next(logits, request.sampling, request.generator)[0])
        now = time.perf_counter()
        if request.last_token_at is None:
            self.observe("ttft", now - request.arrival)
        else:
            self.observe("itl", now - request.last_token_at)
        request.last_token_at = now
        request.generated.append(token)
        self.stats.generation_tokens += 1
        request.emit(token, None)
        if token in request.stop_ids:
            request.finish_reason = "stop"
        elif len(request.generated) >= request.max_tokens:
            request.finish_reason = "length"
        if request.finish_reason is not None:
            request.emit(None, request.finish_reason)
