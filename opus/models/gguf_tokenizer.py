"""The tokenizer of a GGUF file, built by transformers' GGUF support, or a one-line error.

transformers reads the ``tokenizer.ggml.*`` fields (``get_gguf_tokenizer``) and hands them to the
tokenizer class that vocabulary type belongs to (``convert_gguf_tokenizer``): byte-level BPE
(``gpt2``), sentencepiece (``llama``), unigram (``t5``), ``gemma4``. For byte-level BPE the split
rule comes from ``tokenizer.ggml.pre`` through its table of split patterns; a name outside that
table gets GPT-2's own split. Opus keeps no table of patterns: it only decides which names that
fallback stands for (llama.cpp's rule for them is GPT-2's split), so that any other name is an
error naming the field rather than a tokenizer that silently splits text another way.

For the names in ``GPT2_SPLIT_DIGITS_FIRST`` (``smollm`` ...) llama.cpp and the HF original split
every digit off before GPT-2's rule; transformers keeps GPT-2's rule alone, which gave other ids
wherever two or more spaces stand right before a digit ("x  +  1", indentation before a number).
Opus puts the digit split in front, as the HF original does.

Known difference from the Hugging Face tokenizer a GGUF was made from (tests/models/test_gguf_tokenizer.py):

- ``qwen2``: the HF original NFC-normalizes text first; transformers (like llama.cpp) does not, so
  decomposed accents ("e" + U+0301) tokenize differently. Composed text is identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from opus.models.config import ModelLoadError

MODEL_KEY, PRE_KEY, TOKENS_KEY = "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens"
# llama.cpp pre-tokenizer names whose split is GPT-2's regex, the split transformers' byte-level
# tokenizer keeps for names outside its table. "default" (or no name) is what old files carry.
GPT2_SPLIT = ("default", "gpt-2", "mpt", "olmo", "jais")
# llama.cpp splits digits one by one, then GPT-2's regex (LLAMA_VOCAB_PRE_TYPE_SMOLLM and its
# case group); transformers applies GPT-2's regex alone: see the module docstring.
GPT2_SPLIT_DIGITS_FIRST = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")


class Metadata(Protocol):
    """GGUF metadata by key (gguf_file's reader wrapper, or a dict in tests)."""

    def get(self, key: str, default: Any = None) -> Any: ...


def transformers_support() -> tuple[list[str], list[str]]:
    """(vocabulary types, pre-tokenizer names) that transformers' GGUF conversion reproduces."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_PRE_TOKENIZER_SPLITS,
        GGUF_TOKENIZER_TYPES,
    )

    pres = {*GGUF_PRE_TOKENIZER_SPLITS, *GPT2_SPLIT, *GPT2_SPLIT_DIGITS_FIRST}
    return sorted(GGUF_TOKENIZER_TYPES), sorted(pres)


def check_tokenizer_fields(meta: Metadata, path: Path | str) -> None:
    """Raise a one-line ModelLoadError naming the field when transformers cannot build this tokenizer."""
    models, pres = transformers_support()
    model = meta.get(MODEL_KEY)
    if model is None:
        raise ModelLoadError(f"{path}: no {MODEL_KEY}: the file carries no tokenizer (transformers reads "
                             f"{', '.join(models)})")
    if str(model) not in models:
        raise ModelLoadError(f"{path}: {MODEL_KEY} {str(model)!r} is not a vocabulary type transformers reads; "
                             f"supported: {', '.join(models)}")
    if not meta.get(TOKENS_KEY):
        raise ModelLoadError(f"{path}: no {TOKENS_KEY}: the tokenizer has no vocabulary")
    pre = str(meta.get(PRE_KEY) or "default")
    if model == "gpt2" and pre not in pres:
        raise ModelLoadError(f"{path}: {PRE_KEY} {pre!r} is not a pre-tokenizer transformers converts (it would "
                             f"split text with GPT-2's rule instead); supported: {', '.join(pres)}")


def gguf_tokenizer(path: Path | str, meta: Metadata) -> Any:
    """A ``PreTrainedTokenizerFast`` for the GGUF at ``path``; a one-line ModelLoadError when there is none."""
    check_tokenizer_fields(meta, path)
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        architecture, fields, config = get_gguf_tokenizer(str(path))
        if fields.get("tokenizer_type") == "gpt2" and "merges" not in fields and "scores" not in fields:
            # transformers would derive merges from scores, which a byte-level file has none of:
            # no merges in the file means a vocabulary of whole tokens only.
            fields["merges"] = []
        backend, extra = convert_gguf_tokenizer(architecture, fields)
        if fields.get("tokenizer_type") == "gpt2" and str(meta.get(PRE_KEY) or "default") in GPT2_SPLIT_DIGITS_FIRST:
            from tokenizers import pre_tokenizers

            backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                             backend.pre_tokenizer])
        backend = _within_vocabulary(backend, len(fields["tokens"]))
        return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
    except Exception as exc:  # noqa: BLE001 - a malformed vocabulary fails anywhere inside transformers
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ModelLoadError(f"{path}: transformers cannot build its tokenizer ({type(exc).__name__}: "
                             f"{first})") from exc


def _within_vocabulary(backend: Any, size: int) -> Any:
    """The backend without added tokens past the file's vocabulary.

    transformers' tokenizer classes add their default specials when the vocabulary lacks them
    (GPT-2's ``<|endoftext|>`` to a Llama 3 vocabulary, at id 128256): the model has no embedding
    row for such an id, and text that happens to contain the string would index past it.
    """
    import json

    from tokenizers import Tokenizer

    data = json.loads(backend.to_str())
    kept = [t for t in data.get("added_tokens") or [] if t["id"] < size]
    if len(kept) == len(data.get("added_tokens") or []):
        return backend
    data["added_tokens"] = kept
    return Tokenizer.from_str(json.dumps(data))
