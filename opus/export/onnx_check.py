"""The KV-cache ONNX graph in onnxruntime: the plain cached generation loop, parity with torch, P and D.

Parity: for each prompt, torch generates ``greedy_tokens`` greedily with a growing KV cache; onnxruntime
runs the same tokens through its cached loop (teacher-forced: the logits of the prefill and of every
decode step are compared, ``onnx_max_abs_diff``), the prefill's argmax is compared
(``onnx_next_token_agreement``), and onnxruntime generates freely from the prompt
(``onnx_greedy_agreement``: positions where its token equals torch's). W8A8 layers quantize their
activations at every size in the torch reference, as the graph does (it cannot branch on a row count).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from opus.export.onnx_graph import accepts_last_only, ort_session
from opus.export.settings import ExportSettings, make_prompts

P_METHOD = ("cached greedy loop on onnxruntime (prefill of batch_size prompts of input_len, then one-token "
            "steps feeding back present.* as past_key_values.*); tokens/s = batch x new_tokens / seconds, "
            "prefill included; median of repeats after warm-up")
D_METHOD = ("one request of input_len tokens: prefill with an empty cache and argmax of the last logits on "
            "onnxruntime; median of max(repeats, 9) after warm-up")
DECODE_METHOD = "tokens/s of the decode steps of the P loop alone (prefill excluded), median of repeats"
D_SAMPLES = 9


class OrtDecoder:
    """The generation loop over a KV-cache graph: prefill with an empty past, then one token per step."""

    def __init__(self, session: Any, meta: dict[str, Any]) -> None:
        self.session, self.meta = session, meta
        self.past = [i.name for i in session.get_inputs() if i.name.startswith("past_key_values.")]
        self.kv_dtype = np.dtype(meta["kv_dtype"])

    def empty(self, batch: int) -> dict[str, np.ndarray]:
        shape = (batch, self.meta["num_kv_heads"], 0, self.meta["head_dim"])
        return {name: np.zeros(shape, self.kv_dtype) for name in self.past}

    def step(self, ids: np.ndarray, mask: np.ndarray, past: dict[str, np.ndarray]) -> tuple[np.ndarray, dict]:
        positions = np.maximum(mask.cumsum(axis=1) - 1, 0)[:, -ids.shape[1]:]  # left padding: count real tokens
        logits, *presents = self.session.run(None, {"input_ids": ids, "attention_mask": mask,
                                                    "position_ids": positions.astype(np.int64), **past})
        return logits[:, -1], dict(zip(self.past, presents, strict=True))

    def generate(self, ids: np.ndarray, n: int, forced: np.ndarray | None = None, mask: np.ndarray | None = None,
                 on_step: Callable[[], None] | None = None) -> tuple[np.ndarray, list[np.ndarray], float]:
        """``n`` greedy tokens per row (or the ``forced`` ones fed back), each step's last logits, prefill s;
        ``on_step`` after every step (a heartbeat: a large model's loop runs for minutes)."""
        mask = np.ones(ids.shape, np.int64) if mask is None else mask
        past, feed, tokens, logits, prefill_s = self.empty(ids.shape[0]), ids, [], [], 0.0
        start = time.perf_counter()
        for i in range(n):
            last, past = self.step(feed, mask, past)
            nxt = last.argmax(-1)[:, None].astype(np.int64)
            prefill_s = prefill_s or time.perf_counter() - start
            if on_step is not None:  # after the prefill's clock: one pipe write (~8 µs) per step
                on_step()
            logits.append(last)
            tokens.append(nxt)
            feed = nxt if forced is None else forced[:, i:i + 1]
            mask = np.concatenate([mask, np.ones((ids.shape[0], 1), np.int64)], axis=1)
        return np.concatenate(tokens, axis=1), logits, prefill_s


def torch_generate(model: nn.Module, ids: torch.Tensor, n: int,
                   on_step: Callable[[], None] | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """The torch reference: greedy with a growing KV cache; tokens [B, n] and each step's last logits."""
    from opus.kv.cache import GrowingKVCache
    from opus.quant.formats import export_reference

    kw = {"last_only": True} if accepts_last_only(model) else {}
    cache, pos, feed, tokens, logits = GrowingKVCache(len(model.model.layers)), 0, ids, [], []
    with torch.no_grad(), export_reference():
        for _ in range(n):
            last = model(feed, cache=cache, start_pos=pos, **kw)[:, -1].float()
            pos += feed.shape[1]
            feed = last.argmax(-1, keepdim=True)
            logits.append(last.cpu().numpy())
            tokens.append(feed.cpu().numpy())
            if on_step is not None:
                on_step()
    return np.concatenate(tokens, axis=1), logits


def _counter(s: ExportSettings, what: str, total: int) -> Callable[[], None]:
    """Steps done out of ``total``, reported to the stage after each: its progress, ETA and heartbeat."""
    done = itertools.count(1)
    return lambda: s.progress(what, next(done), total)


def session(path: Path, s: ExportSettings) -> Any:
    return ort_session(path, s.device, s.threads)


def parity(model: nn.Module, sess: Any, meta: dict[str, Any], tokenizer: Any, s: ExportSettings) -> dict[str, float]:
    decoder, device = OrtDecoder(sess, meta), next(model.parameters()).device
    n = max(1, s.greedy_tokens)
    max_diff, next_agree, same, total = 0.0, 0, 0, 0
    prompts = make_prompts(tokenizer, meta["vocab_size"], s)
    step = _counter(s, "onnxruntime parity (cached loop)", 3 * n * len(prompts))  # torch, forced, free
    for prompt in prompts:
        ref_tokens, ref_logits = torch_generate(model, prompt.to(device), n, on_step=step)
        ids = prompt.cpu().numpy().astype(np.int64)
        _, forced_logits, _ = decoder.generate(ids, n, forced=ref_tokens, on_step=step)
        max_diff = max(max_diff, *(float(np.abs(a - b).max()) for a, b in zip(forced_logits, ref_logits, strict=True)))
        next_agree += int(forced_logits[0].argmax(-1)[0] == ref_logits[0].argmax(-1)[0])
        free, _, _ = decoder.generate(ids, n, on_step=step)
        same, total = same + int((free == ref_tokens).sum()), total + free.size
    return {"onnx_max_abs_diff": max_diff, "onnx_next_token_agreement": next_agree / len(prompts),
            "onnx_greedy_agreement": same / max(total, 1)}


def measure(sess: Any, meta: dict[str, Any], s: ExportSettings) -> dict[str, float]:
    decoder, rng = OrtDecoder(sess, meta), np.random.default_rng(s.seed)
    single = rng.integers(0, meta["vocab_size"], (1, s.input_len), dtype=np.int64)
    batch = rng.integers(0, meta["vocab_size"], (s.batch_size, s.input_len), dtype=np.int64)

    d_runs, p_runs = s.warmup + max(s.repeats, D_SAMPLES), max(s.warmup, 1) + s.repeats
    step = _counter(s, "onnxruntime P and D (cached loop)", d_runs + p_runs * s.new_tokens)

    def timed(ids: np.ndarray, n: int, runs: int, warmup: int) -> tuple[float, float]:
        totals, prefills = [], []
        for i in range(runs):
            start = time.perf_counter()
            _, _, prefill_s = decoder.generate(ids, n, on_step=step)
            if i >= warmup:
                totals.append(time.perf_counter() - start)
                prefills.append(prefill_s)
        return statistics.median(totals), statistics.median([t - p for t, p in zip(totals, prefills, strict=True)])

    ttft, _ = timed(single, 1, d_runs, s.warmup)
    loop, decode = timed(batch, s.new_tokens, p_runs, max(s.warmup, 1))
    out = {"onnx_ttft_ms": ttft * 1000, "onnx_throughput_tok_s": s.batch_size * s.new_tokens / loop}
    if s.new_tokens > 1 and decode > 0:
        out["onnx_decode_tok_s"] = s.batch_size * (s.new_tokens - 1) / decode
    return out


def methods(s: ExportSettings) -> dict[str, Any]:
    return {"onnx_p_method": P_METHOD, "onnx_d_method": D_METHOD, "onnx_decode_method": DECODE_METHOD,
            "onnx_workload": {"batch_size": s.batch_size, "input_len": s.input_len, "new_tokens": s.new_tokens,
                              "warmup": s.warmup, "repeats": s.repeats, "threads": s.threads}}
