"""The ``hf`` contender: transformers' own model class on the pipeline's Hugging Face directory.

What differs from the fp32 baseline is the model code and the KV cache — transformers' modeling file
(its default attention implementation) and its ``DynamicCache`` — not the workload, prompts or timing:
``HfLM`` puts the transformers model behind the engine's LM interface, so P, D, decode speed,
memory, perplexity and agreement come from the same measurement as every other row. The decoding
loop is the engine's greedy loop; ``generate()``'s per-step logits processors and stopping checks,
which greedy decoding does not need, are not in the figures.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
from pathlib import Path
from typing import Any

import torch
from torch import nn

from opus.bench.core import BenchContext, Built, Contender, Unavailable


class HfCache:
    """The engine's "cache" for a transformers model: transformers' ``DynamicCache``, made per request."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.reset()

    def reset(self) -> None:
        from transformers import DynamicCache

        self.past = DynamicCache(config=self.config)

    @property
    def seq_len(self) -> int:
        return int(self.past.get_seq_length())


class HfLM(nn.Module):
    """A transformers causal LM behind the engine's interface ``(input_ids, cache, start_pos, last_only)``."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf
        self.config = hf.config  # vocab_size for random prompts, like an Opus decoder's config
        params = inspect.signature(hf.forward).parameters
        # transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name is deprecated).
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    def forward(self, input_ids: torch.Tensor, cache: HfCache | None = None, start_pos: int = 0,
                last_only: bool = False) -> torch.Tensor:
        if cache is None:  # perplexity, teacher-forced agreement: every position, no cache kept
            return self.hf(input_ids, use_cache=False).logits
        if cache.seq_len != start_pos:
            raise ValueError(f"the DynamicCache holds {cache.seq_len} positions, the engine asks for {start_pos}")
        # Positions passed explicitly: the engine's start_pos, not whatever the model would infer.
        positions = torch.arange(start_pos, start_pos + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        out = self.hf(input_ids, position_ids=positions, use_cache=True, logits_to_keep=1 if last_only else 0,
                      **{self.cache_arg: cache.past})
        return out.logits


def model_dir(ctx: BenchContext) -> Path:
    """The pipeline's Hugging Face directory, or Unavailable (a GGUF or factory source has none)."""
    if "hf" not in ctx.source:
        kind = next(iter(ctx.source), "unknown")
        raise Unavailable(f"the pipeline's model is a {kind} source, not a Hugging Face directory for "
                          "transformers to load")
    path = Path(ctx.source["hf"]).expanduser()
    return path if path.is_absolute() else ctx.base_dir / path


def _load_args(ctx: BenchContext) -> tuple[Path, dict[str, Any], str]:
    """What ``from_pretrained`` takes for the pipeline's model: its HF directory, or a GGUF file as
    transformers' users load one (``gguf_file=``: dequantized to float by transformers itself)."""
    if "gguf" in ctx.source:
        file = Path(ctx.source["gguf"]).expanduser()
        file = file if file.is_absolute() else ctx.base_dir / file
        if not file.is_file():
            raise Unavailable(f"no GGUF file {file} for transformers to load")
        return file.parent, {"gguf_file": file.name}, f"from the GGUF {file.name} (gguf_file=, dequantized)"
    return model_dir(ctx), {}, ""


def hf(ctx: BenchContext) -> Built:
    path, extra, origin = _load_args(ctx)
    if importlib.util.find_spec("transformers") is None:
        raise Unavailable("transformers is not installed")
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the bench's own display owns the terminal
    try:
        # local_files_only: the bench never reaches a model hub, whatever HF_HUB_OFFLINE says.
        # transformers' GGUF loader draws its own tqdm bar (not its logging's, which is off): through the
        # bench's display it is a second, broken progress line.
        with contextlib.redirect_stderr(io.StringIO()) if "gguf_file" in extra else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True, **extra)
    except (ValueError, KeyError, OSError) as exc:  # e.g. an architecture this transformers does not know
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise Unavailable(f"transformers {transformers.__version__} cannot load {path}: {first}") from None
    model = model.to(ctx.device).eval()
    attention = getattr(model.config, "_attn_implementation", None) or "default"
    notes = [f"transformers {transformers.__version__} {type(model).__name__}{' ' + origin if origin else ''}, "
             f"float32, {attention} attention, "
             "its DynamicCache; stepped by the engine's greedy loop like every row (generate()'s logits "
             "processors and stopping checks are not timed)"]
    lm = HfLM(model)
    return Built(lm, lambda batch, length: HfCache(model.config), notes)


CONTENDERS = (Contender("hf", "transformers eager (DynamicCache)", "transformers", hf),)
