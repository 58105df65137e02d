"""A Hugging Face fast tokenizer written into GGUF metadata (``tokenizer.ggml.*``) as llama.cpp reads it.

The inverse of ``opus.models.gguf_tokenizer``, in the way llama.cpp's ``convert_hf_to_gguf.py`` writes
its tokenizers, through gguf-py where gguf-py has the piece:

- byte-level BPE (``tokenizer.json`` model BPE with a ByteLevel decoder): ``tokenizer.ggml.model``
  ``gpt2``; the tokens by id, padded with ``[PADn]`` (type UNUSED) up to the model's embedding rows,
  added tokens CONTROL when special and USER_DEFINED otherwise (the converter's ``get_vocab_base``).
  The pre-tokenizer name is read off ``tokenizer.json``'s structure, not hashed as the converter does
  (a tokenizer trained by the user, as K3's, is in no hash table): a plain ByteLevel split is
  ``gpt-2``; digits one by one then ByteLevel is ``smollm``; a Split regex then ByteLevel is the name
  transformers' GGUF table gives that regex (``llama-bpe``'s, ``qwen2``'s ...). Any other structure
  is refused with its description, rather than written under a name that splits text differently.
- sentencepiece-style BPE (byte fallback): ``llama``, tokens and types from ``gguf.LlamaHfVocab``;
  its scores are a placeholder (-1000 for every token), and llama.cpp's SPM tokenizer merges by
  score, so each token's score is minus the rank of the merge that makes it (earlier merges first).
- merges, bos/eos/unk/pad ids, whether bos/eos are added and the chat template: ``gguf.SpecialVocab``
  over the tokenizer saved to a temporary directory; add_bos/add_eos are what the tokenizer does.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from opus.models.gguf_tokenizer import GPT2_SPLIT, GPT2_SPLIT_DIGITS_FIRST

# Text whose ids are compared between the source tokenizer and the file's (digits, runs of spaces,
# newlines, accents, contractions, code).
CHECK_TEXTS = ("def main():\n    return 42  # x  +  1\n", "Hello world! It's 3.14159, isn't it?\n\n\tTabs",
               "caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e \U0001f600 1234567890", "import os, sys\nprint('ok')")


class VocabError(ValueError):
    """The tokenizer has no GGUF form Opus can write; the message is one line."""


def _parts(pre: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre] if pre else []


def pre_tokenizer_name(data: dict[str, Any]) -> str:
    """llama.cpp's pre-tokenizer name for a byte-level ``tokenizer.json`` (see the module docstring)."""
    parts = _parts(data.get("pre_tokenizer") or {})
    kinds = [p.get("type") for p in parts]
    last = parts[-1] if parts else {}
    plain_byte_level = kinds[-1:] == ["ByteLevel"] and not last.get("add_prefix_space", False)
    if plain_byte_level and kinds == ["ByteLevel"] and last.get("use_regex", True):
        return GPT2_SPLIT[1]  # "gpt-2"
    if (plain_byte_level and kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits")
            and last.get("use_regex", True)):
        return GPT2_SPLIT_DIGITS_FIRST[0]  # "smollm"
    if plain_byte_level and kinds == ["Split", "ByteLevel"] and not last.get("use_regex", True):
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

        pattern = (parts[0].get("pattern") or {}).get("Regex")
        name = next((n for n, p in GGUF_PRE_TOKENIZER_SPLITS.items() if p == pattern), None)
        if name and parts[0].get("behavior", "Isolated") == "Isolated" and not parts[0].get("invert"):
            return name
    described = "+".join(str(k) for k in kinds) or "none"
    raise VocabError(f"pre-tokenizer {described} has no llama.cpp name Opus can tell (known: a ByteLevel split, "
                     "digits then ByteLevel, or a Split regex of transformers' GGUF table then ByteLevel)")


def _gpt2_tokens(tokenizer: Any, vocab_size: int) -> tuple[list[str], list[int]]:
    import gguf

    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, [int(t) for t in types]


def _llama_tokens(directory: Path, data: dict[str, Any],
                  vocab_size: int) -> tuple[list[bytes], list[float], list[int]]:
    import gguf

    vocab = gguf.LlamaHfVocab(directory)
    merges = data["model"].get("merges") or []
    rank = {(m if isinstance(m, str) else " ".join(m)).replace(" ", ""): r for r, m in enumerate(merges)}
    tokens, scores, types = [], [], []
    for text, _, kind in vocab.all_tokens():
        tokens.append(text)
        scores.append(-float(rank.get(text.decode("utf-8", "replace"), len(merges))) if kind == 1 else 0.0)
        types.append(int(kind))
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1e9)
        types.append(int(gguf.TokenType.UNUSED))
    return tokens, scores, types


def _adds(tokenizer: Any, token_id: int | None, first: bool) -> bool:
    ids = tokenizer("a")["input_ids"]
    return token_id is not None and bool(ids) and ids[0 if first else -1] == token_id


def add_tokenizer(writer: Any, tokenizer: Any, vocab_size: int, bos: int | None, eos: int | None) -> dict[str, Any]:
    """Write the tokenizer into ``writer`` (a ``gguf.GGUFWriter``); returns what was written, for the record."""
    if tokenizer is None or not getattr(tokenizer, "is_fast", False):
        raise VocabError("no Hugging Face fast tokenizer: llama.cpp needs the vocabulary in the file")
    if len(tokenizer) > vocab_size:
        raise VocabError(f"the tokenizer has {len(tokenizer)} tokens, the model's embedding {vocab_size} rows")
    import gguf

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        tokenizer.save_pretrained(directory)
        ids = {f"{k}_token_id": v for k, v in (("bos", bos), ("eos", eos)) if isinstance(v, int)}
        (directory / "config.json").write_text(json.dumps(ids), encoding="utf-8")  # SpecialVocab's fallback
        data = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
        model, decoder = data.get("model") or {}, data.get("decoder") or {}
        if model.get("type") == "BPE" and model.get("byte_fallback"):
            kind, pre = "llama", "default"
            tokens, scores, types = _llama_tokens(directory, data, vocab_size)
            writer.add_token_scores(scores)
        elif model.get("type") == "BPE" and decoder.get("type") == "ByteLevel":
            kind, pre = "gpt2", pre_tokenizer_name(data)
            tokens, types = _gpt2_tokens(tokenizer, vocab_size)
        else:
            raise VocabError(f"tokenizer model {model.get('type')!r} with decoder {decoder.get('type')!r}: "
                             "Opus writes byte-level BPE (gpt2) and sentencepiece-style BPE (llama) only")
        writer.add_tokenizer_model(kind)
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        special = gguf.SpecialVocab(directory, load_merges=True, n_vocab=vocab_size)
        ids_found = special.special_token_ids
        special.add_special_token["bos"] = _adds(tokenizer, ids_found.get("bos"), first=True)
        special.add_special_token["eos"] = _adds(tokenizer, ids_found.get("eos"), first=False)
        special.add_to_gguf(writer, quiet=True)
    return {"model": kind, "pre": pre, "tokens": len(tokenizer), "padding": vocab_size - len(tokenizer),
            "merges": len(special.merges), "special_ids": dict(ids_found)}


def check_roundtrip(path: Path, source: Any, written: dict[str, Any]) -> str | None:
    """None when the file's tokenizer (as Opus and transformers read it) gives the source's ids on
    ``CHECK_TEXTS``; else the first difference, in one line. ``written``: what ``add_tokenizer`` returned."""
    from opus.models.gguf_tokenizer import MODEL_KEY, PRE_KEY, TOKENS_KEY, gguf_tokenizer

    meta = {MODEL_KEY: written["model"], PRE_KEY: written["pre"], TOKENS_KEY: written["tokens"] > 0}
    try:
        from_file = gguf_tokenizer(path, meta)
    except Exception as exc:  # noqa: BLE001 - a ModelLoadError, or transformers failing on the vocabulary
        return f"transformers cannot read the file's tokenizer back: {exc}"
    for text in CHECK_TEXTS:
        want, got = source.encode(text, add_special_tokens=False), from_file.encode(text, add_special_tokens=False)
        if want != got:
            return f"{text!r}: source ids {want[:12]}..., the file's {got[:12]}..."
    return None
