"""``StaticRunner``: greedy generation on a FastDecoder with a static KV cache and CUDA graphs.

    runner = StaticRunner(model, batch_size=32, max_seq_len=640)          # or StaticRunner(fast_decoder, ...)
    result = runner.generate(prompt_ids, new_tokens=128)                  # opus.runtime.engine.GenerationResult

Every tensor a step touches lives in a buffer allocated once: the current token ``tok [B, 1]``, its
position ``pos [1]``, the step counter, the generated tokens and the last logits. A decode step
reads ``tok`` and ``pos``, writes the cache slot, picks the argmax, and advances ``tok``, ``pos`` and
the step counter itself — so on CUDA it is captured once (``torch.cuda.CUDAGraph``) and each later
step is one ``replay()`` with no Python work. Prefill is captured too, once per prompt length, when
the experts can run grouped (no host sync). On CPU nothing is captured and the same step functions
run eagerly: that is how the CPU tests prove the captured code computes what opus.runtime.engine computes.

Greedy only; prompts of equal length; prefill starts at position 0 (a new batch overwrites the cache).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from opus.bench.static_path.fast_decoder import FastDecoder
from opus.fusion.moe import EXPERT_MODES
from opus.models.decoder import DecoderLM
from opus.runtime.engine import GenerationResult


class StaticRunner:
    def __init__(self, model: DecoderLM | FastDecoder, batch_size: int, max_seq_len: int, *,
                 capture: bool | None = None, capture_prefill: bool | None = None, decode_experts: str = "dense",
                 quant: str | None = None, quant_experts: bool = True) -> None:
        self.fast = model if isinstance(model, FastDecoder) else FastDecoder(model, quant, quant_experts)
        if decode_experts not in EXPERT_MODES:
            raise ValueError(f"decode_experts must be one of {', '.join(EXPERT_MODES)}, got {decode_experts!r}")
        self.notes: list[str] = []
        if decode_experts == "grouped" and self.fast.grouped_reason and self.fast.has_moe:
            # sorted would break capture; dense computes the same and captures
            self.notes.append(f"decode experts run dense, not grouped: {self.fast.grouped_reason}")
            decode_experts = "dense"
        self.decode_experts = decode_experts
        device = self.fast.device
        on_cuda = device.type == "cuda"
        self.capture = on_cuda if capture is None else capture and on_cuda
        grouped_ok = self.fast.grouped_reason is None or not self.fast.has_moe
        self.capture_prefill = (self.capture if capture_prefill is None else capture_prefill and on_cuda) and grouped_ok
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        # Slots rounded up to a multiple of 16: attention kernels want an aligned mask row.
        self.cache = self.fast.new_cache(batch_size, -(-max_seq_len // 16) * 16)
        vocab = self.fast.lm_head.weight.shape[0]
        self.tok = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.step = torch.zeros(1, dtype=torch.long, device=device)
        self.tokens = torch.zeros(batch_size, max_seq_len, dtype=torch.long, device=device)
        self.logits = torch.zeros(batch_size, vocab, dtype=self.fast.dtype, device=device)
        self._host_pos = 0  # Python mirror of ``pos`` for bounds checks (no device sync)
        self._prefill_ids: dict[int, torch.Tensor] = {}
        self._positions: dict[int, torch.Tensor] = {}
        self._prefill_graphs: dict[int, torch.cuda.CUDAGraph | None] = {}  # None: capture failed, run eagerly
        self._decode_graph: torch.cuda.CUDAGraph | None = None
        self._decode_tried = False

    @property
    def device(self) -> torch.device:
        return self.fast.device

    def captured(self, which: str) -> bool:
        """Whether a ``"decode"`` or ``"prefill"`` CUDA graph exists (capture may be off, or have failed)."""
        if which == "decode":
            return self._decode_graph is not None
        return any(g is not None for g in self._prefill_graphs.values())

    # -- the step bodies (captured on CUDA) ---------------------------------------------------------
    def _prefill_body(self, t: int) -> None:
        logits = self.fast(self._prefill_ids[t], self._positions[t], self.cache, prefill=True,
                           experts=self.fast.prefill_mode())
        nxt = logits.argmax(dim=-1)
        self.logits.copy_(logits)
        self.tokens[:, 0].copy_(nxt)
        self.tok.copy_(nxt.unsqueeze(1))
        self.pos.fill_(t)
        self.step.fill_(1)

    def _decode_body(self) -> None:
        logits = self.fast(self.tok, self.pos, self.cache, prefill=False, experts=self.decode_experts)
        nxt = logits.argmax(dim=-1)
        self.logits.copy_(logits)
        self.tokens.index_copy_(1, self.step, nxt.unsqueeze(1))
        self.tok.copy_(nxt.unsqueeze(1))
        self.pos.add_(1)
        self.step.add_(1)

    def _capture(self, body: Callable[[], None], what: str) -> torch.cuda.CUDAGraph | None:
        """Warm ``body`` up on a side stream and capture it; None (and a note) if capture fails.

        The warm-up advances ``tok``/``pos``/``step`` and writes cache slots past the current position;
        the state is restored afterwards, and those slots are masked until rewritten.
        """
        saved = [t.clone() for t in (self.tok, self.pos, self.step)]
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                body()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                body()
        except RuntimeError as e:  # an op that cannot be captured: keep going uncaptured, say so
            torch.cuda.synchronize(self.device)
            self.notes.append(f"{what} not captured, runs eagerly: {str(e).splitlines()[0][:200]}")
            graph = None
        finally:
            for buf, old in zip((self.tok, self.pos, self.step), saved):
                buf.copy_(old)
        return graph

    # -- public API ---------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt ``ids`` ([B, T]) from position 0; returns the last-position logits ``[B, V]``.

        The first generated token is ``runner.tokens[:, 0]`` (and ``runner.tok``).
        """
        b, t = ids.shape
        if b != self.batch_size:
            raise ValueError(f"this runner was built for batch {self.batch_size}, got {b} prompts")
        if t > self.max_seq_len:
            raise ValueError(f"prompt of {t} tokens exceeds max_seq_len {self.max_seq_len}")
        if t not in self._prefill_ids:
            self._prefill_ids[t] = torch.zeros(b, t, dtype=torch.long, device=self.device)
            self._positions[t] = torch.arange(t, device=self.device)
        self._prefill_ids[t].copy_(ids)
        self._host_pos = t
        if self.capture_prefill and t not in self._prefill_graphs:
            self._prefill_graphs[t] = self._capture(lambda: self._prefill_body(t), f"prefill (length {t})")
        graph = self._prefill_graphs.get(t)
        if graph is None:
            self._prefill_body(t)
        else:
            graph.replay()
        return self.logits

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One greedy step; returns the new tokens ``[B]`` (a view of a buffer the next step overwrites).

        ``tokens`` ([B]) replaces the runner's own last token first (teacher forcing, for parity checks).
        """
        if self._host_pos >= self.max_seq_len:
            raise ValueError(f"max_seq_len {self.max_seq_len} reached")
        if tokens is not None:
            self.tok.copy_(tokens.reshape(-1, 1))
        if self.capture and not self._decode_tried:
            self._decode_tried = True
            self._decode_graph = self._capture(self._decode_body, "decode step")
        if self._decode_graph is None:
            self._decode_body()
        else:
            self._decode_graph.replay()
        self._host_pos += 1
        return self.tok[:, 0]

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, new_tokens: int) -> GenerationResult:
        """Greedy ``new_tokens`` per row; timings bracketed with ``torch.cuda.synchronize`` on CUDA."""
        if new_tokens < 1:
            raise ValueError("new_tokens must be at least 1")
        t = prompt_ids.shape[1]
        if t + new_tokens - 1 > self.max_seq_len:
            raise ValueError(f"{t} + {new_tokens} tokens exceed max_seq_len {self.max_seq_len}")
        ids = prompt_ids.to(self.device)
        self._sync()
        start = time.perf_counter()
        self.prefill(ids)
        self._sync()
        first = time.perf_counter()
        for _ in range(new_tokens - 1):
            self.decode_step()
        self._sync()
        end = time.perf_counter()
        return GenerationResult(tokens=self.tokens[:, :new_tokens].clone(), prompt_len=t, ttft_s=first - start,
                                decode_s=end - first, total_s=end - start)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
