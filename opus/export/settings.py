"""What every export target is given (``ExportSettings``) and the helpers they share: the check prompts,
the vocabulary size, one line for an exporter's failure, and a call that reports nothing until it ends."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn


def vocab_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    if getattr(config, "vocab_size", None):
        return int(config.vocab_size)
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise TypeError(f"{type(model).__name__} has no embedding: not a language model taking input_ids")
    return int(embedding.num_embeddings)


@dataclass
class ExportSettings:
    source: dict[str, Any]
    base_dir: Path
    dtype: str = "float32"
    device: str = "cpu"
    onnx: bool = True
    hf: bool = True  # Hugging Face directory with compressed-tensors (opus.export.hf_compressed)
    gguf: bool = True  # GGUF with the plan's per-tensor types (opus.export.gguf_mix)
    prompts: list[str] = field(default_factory=lambda: ["def main():\n", "import os\nimport sys\n"])
    # Held-out text (token blocks, one row each) the HF export's logits are compared with Opus's on.
    held_out: list[torch.Tensor] = field(default_factory=list)
    prompt_len: int = 16  # random prompts of this length when the model has no tokenizer
    greedy_tokens: int = 8
    batch_size: int = 1
    input_len: int = 64
    new_tokens: int = 4
    warmup: int = 1
    repeats: int = 3
    threads: int | None = None
    last_only: bool = True  # export next-token logits only (when the model supports it)
    seed: int = 0
    # progress(what, done=0, total=None): the stage's progress line and its heartbeat.
    progress: Callable[..., None] = field(default=lambda what, done=0, total=None: None, repr=False)
    # compiling(True/False): around a call that reports nothing until it ends (opaque_call).
    compiling: Callable[[bool], None] = field(default=lambda active: None, repr=False)


@contextmanager
def opaque_call(s: ExportSettings) -> Iterator[None]:
    """torch.export's graph capture and onnxruntime's graph optimization report nothing until they end
    (minutes on a large model): told to the stage as a compile, so that its line says so and the watchdog
    waits ``run.compile_timeout_s`` rather than calling the silence a stall."""
    s.compiling(True)
    try:
        yield
    finally:
        s.compiling(False)


def make_prompts(tokenizer: Any, vocab: int, s: ExportSettings) -> list[torch.Tensor]:
    if tokenizer is not None and hasattr(tokenizer, "encode"):
        encoded = [tokenizer.encode(text) for text in s.prompts]
        ids = [getattr(e, "ids", e) for e in encoded]  # tokenizers.Encoding or a list
        prompts = [torch.tensor([list(i)], dtype=torch.long) for i in ids if len(i)]
        if prompts:
            return prompts
    gen = torch.Generator().manual_seed(s.seed)
    return [torch.randint(0, vocab, (1, s.prompt_len), generator=gen) for _ in range(max(1, len(s.prompts)))]


def one_line(exc: BaseException) -> str:
    """The root cause's first line: the exporter's own top-level message is generic ("step 3/3 ...")."""
    root, seen = exc, {id(exc)}
    while (nxt := root.__cause__ or root.__context__) is not None and id(nxt) not in seen:
        root = nxt
        seen.add(id(root))
    text = re.sub(r"\x1b\[[0-9;]*m", "", f"{type(root).__name__}: {root}")
    return next((line.strip() for line in text.splitlines() if line.strip()), type(root).__name__)[:400]

