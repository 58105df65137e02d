"""The batched decode step of the serving engine: one compiled graph per batch bucket.

A step's batch is padded to the next bucket (1, 2, 4, ... and ``max_batch`` itself), so a handful of
graphs serve every batch size; the number of key positions (``S``, rounded up to whole blocks) is a
dynamic dimension of each graph, so a growing context never recompiles. Padding rows read and write
the scratch block only, and their logits are dropped. ``compile_decode=False`` (or a failed compile)
runs the same step eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from opus.kv.compiled_steps import compile_step
from opus.serve.kv_blocks import SCRATCH_BLOCK, KVBlockPool, PagedView


def buckets_up_to(max_batch: int) -> list[int]:
    """1, 2, 4, ... below ``max_batch``, then ``max_batch``."""
    out, size = [], 1
    while size < max_batch:
        out.append(size)
        size *= 2
    return [*out, max_batch]


class DecodeSteps:
    def __init__(self, model: nn.Module, pool: KVBlockPool, max_batch: int, compile_decode: bool) -> None:
        self.model, self.pool = model, pool
        self.buckets = buckets_up_to(max_batch)
        self.compiled = compile_decode
        # Each bucket is a graph of its own: dynamo's default limit (8 graphs per step) must not send a
        # bucket back to eager.
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, len(self.buckets) + 2)
        eager = self._eager_step()
        self._step: Callable[..., torch.Tensor] = compile_step(eager, dynamic=None) if compile_decode else eager
        self._eager = eager
        self.notes: list[str] = []

    def _eager_step(self) -> Callable[..., torch.Tensor]:
        model = self.model

        def step(ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor, read_slots: torch.Tensor,
                 k: list[torch.Tensor], v: list[torch.Tensor]) -> torch.Tensor:
            return model(ids, cache=PagedView(k, v, positions, write_slots, read_slots), last_only=True)[:, -1]

        return step

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def run(self, tokens: list[int], positions: list[int], tables: list[list[int]], block_size: int) -> torch.Tensor:
        """Logits ``[len(tokens), V]`` of each row's token at its position, its K/V written to its blocks."""
        rows, padded = len(tokens), self.bucket(len(tokens))
        spare = padded - rows
        width = max(len(t) for t in tables)
        table = torch.full((padded, width), SCRATCH_BLOCK, dtype=torch.long)
        for row, blocks in enumerate(tables):
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        # Keys up to the furthest position, in whole blocks: S changes once per block, not per token.
        keys = -(-(max(positions) + 1) // block_size) * block_size
        # Made fresh, not sliced from a wider tensor: a slice's row stride would be a guard of its own
        # (a recompile for every new width; torch calls a one-row slice contiguous, so .contiguous() won't do).
        at = torch.arange(keys)
        read = table.gather(1, (at // block_size).expand(padded, keys)) * block_size + at % block_size
        pos = torch.tensor(positions + [0] * spare, dtype=torch.long)
        write = read.gather(1, pos[:, None]).squeeze(1)
        ids = torch.tensor(tokens + [0] * spare, dtype=torch.long)[:, None]
        args = (ids, pos[:, None], write, read)
        if self.compiled:
            # One graph per bucket (the batch static, as each bucket's kernels were made for it), the
            # number of keys symbolic in each.
            for tensor in args:
                torch._dynamo.mark_static(tensor, 0)
            torch._dynamo.mark_dynamic(read, 1)
        return self._call(*args)[:rows]

    def _call(self, *args: torch.Tensor) -> torch.Tensor:
        try:
            return self._step(*args, self.pool.k, self.pool.v)
        except Exception as exc:  # noqa: BLE001 - no C++ compiler, an op inductor cannot lower
            if self._step is self._eager:
                raise
            self.notes.append(f"decode step not compiled, runs eagerly: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:200]}")
            self._step = self._eager
            return self._eager(*args, self.pool.k, self.pool.v)

    def warm_up(self, block_size: int, on_bucket: Callable[[int, int], None] | None = None) -> None:
        """Run (and so compile) every bucket once, on the scratch block only."""
        for index, batch in enumerate(self.buckets):
            if on_bucket is not None:
                on_bucket(index, batch)
            with torch.inference_mode():  # as the engine runs: compiled for inference, no autograd
                self.run([0] * batch, [block_size] * batch, [[SCRATCH_BLOCK, SCRATCH_BLOCK]] * batch, block_size)
