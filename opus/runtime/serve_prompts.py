"""Prompts for serving measurements: windows of the pipeline's own text, each request its own.

Shared by the serve_bench stage and ``opus bench --serve``, so both send the same kind of prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opus.errors import InputError


def pipeline_tokenizer(spec: Any, base_dir: Path, where: Path) -> Any:
    """The tokenizer of the pipeline's model source (the tokenizer alone, where the source allows)."""
    source = spec.model.source()
    if "hf" in source:  # the tokenizer alone: no need to build the model for it
        from opus.models.hf import load_hf_tokenizer
        from opus.models.hub import resolve_hf_dir

        tokenizer = load_hf_tokenizer(resolve_hf_dir(source["hf"], base_dir))
    else:
        from opus.models import load_model

        tokenizer = load_model(source, base_dir)[1]
    if tokenizer is None:
        raise InputError("the model has no tokenizer: the servers take text prompts", file=str(where), key="model")
    return tokenizer


def _decode(tokenizer: Any, ids: list[int]) -> str:
    # Without special tokens: the end-of-text that joins documents would be parsed as one by the servers.
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def serve_prompts(data: Any, base_dir: Path, tokenizer: Any, count: int, input_len: int) -> tuple[list[str], str]:
    """``count`` prompts of ``input_len`` tokens of the pipeline's evaluation text (else calibration
    text), decoded to text; else seeded random token ids.

    Windows of the token stream at distinct, seeded start offsets (they may overlap): no two prompts
    share a first token block, so no prefix cache answers one from another, and a few hundred KB of
    text give thousands of prompts. Only a text shorter than ``count`` windows makes prompts repeat."""
    import random

    from opus.runtime.data import random_blocks, token_stream

    text_set = data.evaluation or data.calibration
    if text_set is not None:
        stream, where = token_stream(text_set, tokenizer, base_dir)
        starts = stream.numel() - input_len + 1
        if starts > 0:
            chosen = random.Random(text_set.seed).sample(range(starts), min(count, starts))
            prompts = [_decode(tokenizer, stream[s:s + input_len].tolist()) for s in chosen]
            reuse = (f", each used {count / len(chosen):.1f}× in turn (too little text for {count}: a server's "
                     "prefix cache may answer a repeat)") if len(chosen) < count else ""
            return prompts, f"{len(chosen)} {input_len}-token windows at distinct offsets of {where}{reuse}"
    ids = random_blocks(count, input_len, len(tokenizer), seed=0)
    return [_decode(tokenizer, row.tolist()) for row in ids], f"{count} prompts of {input_len} seeded random token ids"
