"""``OpusLM``: lm-evaluation-harness's model class ``opus``, running what an Opus run made.

``--model_args path=RUN_OR_EXPORT`` loads as ``opus.load`` does (its last export, else its final
checkpoint), so the harness scores the run's formats and fused modules; generation goes through Opus's
engine and the KV cache the run chose, as ``opus serve`` does. Other arguments: ``batch_size`` (default
8), ``max_length`` (default the model's context), ``max_gen_toks`` (default 256), ``eager`` (decode steps
uncompiled), ``trust_code`` (code a run names, as ``opus.load``).

Loglikelihood requests are scored in one cache-less forward pass each, longest first, right-padded to
the batch's length (causal attention: padding after a row never reaches it; activations are quantized
per token, so a row's neighbours do not change its scales). Generation batches requests whose prompts
have the same token length and the same settings, and stops when every row has met a stop sequence.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from opus.errors import InputError
from opus.kv.cache import CacheFactory, GrowingKVCache, cache_factory
from opus.kv.choice import cache_config_from_recipe
from opus.made import load_made
from opus.runtime.engine import Sampling, eos_ids, full_logits, generate, logits_of, model_device, supports_cache

Scored = tuple[float, bool]


def _flag(value: Any) -> bool:
    """A model_args value (``eager=true`` arrives as a string or a bool) as a bool."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


@register_model("opus")
class OpusLM(TemplateLM):
    """The harness's view of an Opus model: ``OpusLM(path=...)`` or ``OpusLM.of(model, tokenizer, cache)``."""

    def __init__(self, path: str | None = None, batch_size: int | str = 8, max_length: int | None = None,
                 max_gen_toks: int = 256, eager: bool | str = False, trust_code: bool | str = False,
                 device: str | None = None, **unused: Any) -> None:
        super().__init__()
        if path is None:
            raise InputError("the opus model needs path=RUN_OR_EXPORT in --model_args")
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            # The harness's command line asks for cuda unless told otherwise: here the model's own device.
            print(f"opus: no {device} here: the model runs on the device it was made for", file=sys.stderr)
            device = None
        loaded, origin = load_made(Path(path), device, _flag(trust_code))
        cache = cache_config_from_recipe(loaded.state.get("recipe"))
        if _flag(eager) and cache and cache.get("compile"):
            cache = {**cache, "compile": False}
            cache.pop("compile_prefill", None)
        self._setup(loaded.model, loaded.tokenizer, cache_factory(loaded.model, cache), batch_size, max_length,
                    max_gen_toks)
        self.origin: Path | None = origin
        self.quiet = False  # the harness's own progress bars: shown on the command line, not in a stage

    @classmethod
    def of(cls, model: torch.nn.Module, tokenizer: Any, factory: CacheFactory | None = None, batch_size: int = 8,
           max_length: int | None = None, max_gen_toks: int = 256) -> OpusLM:
        """A model already in memory (the eval stage's candidate or baseline) and its caches' factory
        (default: the growing cache)."""
        lm = cls.__new__(cls)
        TemplateLM.__init__(lm)
        lm._setup(model, tokenizer, factory or cache_factory(model), batch_size, max_length, max_gen_toks)
        lm.origin, lm.quiet = None, True
        return lm

    heartbeat: Callable[[], None] | None = None  # called after each forward batch and generation (a stage's progress)

    def _beat(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat()

    def _setup(self, model: torch.nn.Module, tokenizer: Any, factory: CacheFactory, batch_size: int | str,
               max_length: int | None, max_gen_toks: int) -> None:
        if tokenizer is None:
            raise InputError("the model has no tokenizer: the harness's tasks are text")
        self.model, self.tokenizer = model.eval(), tokenizer
        self._factory = factory
        # "auto" (the harness's own option) has nothing to search here: the default batch stands.
        self.batch_size = 8 if str(batch_size).startswith("auto") else max(1, int(batch_size))
        context = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 2048
        self.max_length = int(max_length) if max_length else int(context)
        self.max_gen_toks = int(max_gen_toks)
        self._eos = eos_ids(tokenizer, model)

    # -- what the harness asks of a TemplateLM -----------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return min(self._eos) if self._eos else 0

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return bos if isinstance(bos, int) else self.eot_token_id

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return list(self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"])

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InputError("the model's tokenizer has no chat template: run without --apply_chat_template")
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    # -- scoring -----------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[Scored]:
        """The harness's tokenized (key, context, continuation) requests, scored. Continuations of one
        context (a multiple-choice question's choices) share one prefill of it, through a KV cache."""
        rows = [self._window(context, continuation) for _, context, continuation in requests]
        targets = [continuation for _, _, continuation in requests]
        by_context: dict[tuple[int, ...], list[int]] = {}
        if supports_cache(self.model):
            for index, (ids, n) in enumerate(rows):  # the context: every input token before the continuation's
                by_context.setdefault(tuple(ids[: len(ids) - n + 1]), []).append(index)
        shared = {context: group for context, group in by_context.items() if len(group) > 1}
        answers: list[Scored] = [(0.0, False)] * len(rows)
        in_groups = {i for group in shared.values() for i in group}
        alone = [i for i in range(len(rows)) if i not in in_groups]
        for context, group in shared.items():
            for index, answer in zip(group, self.score_shared(list(context), [targets[i] for i in group])):
                answers[index] = answer
        for index, answer in zip(alone, self.score_rows([rows[i] for i in alone], [targets[i] for i in alone])):
            answers[index] = answer
        for (key, _, _), answer in zip(requests, answers):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def _window(self, context: list[int], continuation: list[int]) -> tuple[list[int], int]:
        """The model's input (the last ``max_length`` tokens, the final one left out) and how many of its
        last positions predict the continuation."""
        if not continuation:
            raise InputError("a loglikelihood request with an empty continuation")
        whole = (context + continuation)[-(self.max_length + 1):]
        return whole[:-1], len(continuation)

    def score_shared(self, prefix: list[int], continuations: list[list[int]]) -> list[Scored]:
        """Continuations of one prefix: the prefix prefilled once (batch 1, a growing KV cache), then every
        continuation's tokens but its last in rows of one batch over copies of that cache."""
        with torch.inference_mode():
            cache = GrowingKVCache(getattr(getattr(self.model, "config", None), "num_layers", None))
            first = logits_of(self.model(torch.tensor([prefix]), cache=cache, start_pos=0, last_only=True))
            first = F.log_softmax(first[0, -1].float(), dim=-1).cpu()
            out = [(float(first[c[0]]), int(first.argmax()) == c[0]) for c in continuations]
            longest = max(len(c) for c in continuations)
            for start in range(0, len(continuations) if longest > 1 else 0, self.batch_size):
                chunk = continuations[start : start + self.batch_size]
                batch = torch.zeros(len(chunk), longest - 1, dtype=torch.long)
                for r, c in enumerate(chunk):
                    batch[r, : len(c) - 1] = torch.tensor(c[:-1], dtype=torch.long)
                logits = logits_of(self.model(batch, cache=cache.repeated(len(chunk)), start_pos=len(prefix),
                                              last_only=False))
                logprobs = F.log_softmax(logits.float(), dim=-1).cpu()
                for r, c in enumerate(chunk):
                    tail, want = logprobs[r, : len(c) - 1], torch.tensor(c[1:])
                    score, greedy = out[start + r]
                    out[start + r] = (score + float(tail.gather(1, want[:, None]).sum()),
                                      greedy and bool((tail.argmax(-1) == want).all()))
        self._beat()
        return out

    def score_rows(self, rows: list[tuple[list[int], int]], targets: list[list[int]]) -> list[Scored]:
        """(sum of log-probabilities of ``targets``, all greedy) for each row's last positions, longest
        rows batched first."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        out: list[Scored] = [(0.0, False)] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            width = len(rows[chunk[0]][0])
            batch = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, i in enumerate(chunk):
                batch[r, : len(rows[i][0])] = torch.tensor(rows[i][0])
            logprobs = F.log_softmax(full_logits(self.model, batch).float(), dim=-1).cpu()
            for r, i in enumerate(chunk):
                ids, n = rows[i]
                tail = logprobs[r, len(ids) - n : len(ids)]
                want = torch.tensor(targets[i])
                out[i] = (float(tail.gather(1, want[:, None]).sum()), bool((tail.argmax(-1) == want).all()))
            self._beat()
        return out

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[Scored]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or self.quiet)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        out = []
        for request in requests:
            (text,) = request.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1)]
            rows = [((context + continuation)[:-1], len(continuation)) for context, continuation in windows]
            total = sum(s for s, _ in self.score_rows(rows, [c for _, c in windows]))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    # -- generation --------------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        groups: dict[tuple[Any, ...], list[int]] = {}
        prompts, settings = [], []
        for index, request in enumerate(requests):
            context, kwargs = request.args
            until, limit, sampling = self._gen_settings(dict(kwargs or {}))
            ids = self.tok_encode(context) or [self.prefix_token_id]
            ids = ids[-max(1, self.max_length - limit):]
            prompts.append(ids)
            settings.append((until, limit, sampling))
            groups.setdefault((len(ids), tuple(until), limit, sampling), []).append(index)
        out = [""] * len(requests)
        for (_, until, limit, sampling), indices in groups.items():
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start : start + self.batch_size]
                texts = self._generate([prompts[i] for i in chunk], list(until), limit, sampling)
                for i, text in zip(chunk, texts):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    def _gen_settings(self, kwargs: dict[str, Any]) -> tuple[list[str], int, Sampling | None]:
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        limit = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        sampling = None
        if kwargs.pop("do_sample", False) and temperature > 0:
            sampling = Sampling(temperature=temperature, top_k=int(kwargs.pop("top_k", 0) or 0),
                                top_p=float(kwargs.pop("top_p", 1.0) or 1.0), seed=int(kwargs.pop("seed", 0) or 0))
        return until, max(1, limit), sampling

    def _generate(self, prompts: list[list[int]], until: list[str], limit: int, sampling: Sampling | None) -> list[str]:
        batch = torch.tensor(prompts, dtype=torch.long)
        done = self._stopper(until, len(prompts))
        # Caches sized by power-of-two buckets, not by each request's length: a run's compiled decode steps
        # are specialised to their cache's size, and the harness's prompts come in every length.
        result = generate(self.model, batch, limit, lambda rows, length: self._factory(rows, self._bucket(length)),
                          sampling, done=done)
        self._beat()
        return [self._cut(row.tolist(), until) for row in result.tokens.cpu()]

    def _bucket(self, length: int) -> int:
        return max(length, min(1 << max(6, (length - 1).bit_length()), self.max_length))

    def _stopper(self, until: list[str], rows: int) -> Callable[[torch.Tensor], bool]:
        def done(tokens: torch.Tensor) -> bool:
            ended = 0
            for row in tokens.cpu().tolist():
                if any(t in self._eos for t in row) or (until and any(s in self.tok_decode(row) for s in until)):
                    ended += 1
            return ended == rows
        return done

    def _cut(self, ids: list[int], until: list[str]) -> str:
        end = next((i for i, t in enumerate(ids) if t in self._eos), len(ids))
        text = self.tok_decode(ids[:end])
        for stop in until:
            if stop and stop in text:
                text = text[: text.index(stop)]
        return text
