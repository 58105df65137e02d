"""Calibration and evaluation text: declared once in the pipeline, tokenized by each model's tokenizer.

A text set (``opus.spec.TextSetSpec``) is either files/globs relative to the pipeline's directory
(each file one document; ``.jsonl`` files one JSON object per line, text in ``text_column``) or a
``datasets`` dataset saved with ``save_to_disk``. Documents are tokenized with the model's own
tokenizer (a ``tokenizers.Tokenizer`` or a transformers tokenizer), joined with the end-of-text
token when the tokenizer has one, cut into non-overlapping ``seq_len`` blocks, and ``samples`` blocks
are drawn with a seeded ``random.Random`` (stable across Python and torch versions).

Everything stays in memory: nothing is written to the ``datasets`` cache in the home directory and
nothing needs the network. Fingerprints for stage keys: ``opus.fingerprint.fingerprint_text_set``.
"""

from __future__ import annotations

import glob
import json
import random
from pathlib import Path
from typing import Any

import torch

from opus.errors import OpusError
from opus.spec import TextSetSpec

EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


class DataError(OpusError):
    """A text set cannot be read or is too small; the message names the file or dataset."""


def _files(text_set: TextSetSpec, base_dir: Path) -> list[Path]:
    paths: list[Path] = []
    for pattern in text_set.files or []:
        matched = sorted(Path(p) for p in glob.glob(str(base_dir / pattern), recursive=True))
        matched = [p for p in matched if p.is_file()]
        if not matched:
            raise DataError(f"no file matches '{pattern}' (relative to {base_dir})")
        paths.extend(p for p in matched if p not in paths)
    return paths


def _read_file(path: Path, column: str) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    if path.suffix != ".jsonl":
        return [text]
    docs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{number}: invalid JSON: {exc}") from None
        if not isinstance(record, dict) or column not in record:
            raise DataError(f"{path}:{number}: no '{column}' field (set text_column)")
        docs.append(str(record[column]))
    return docs


def _dataset_texts(text_set: TextSetSpec, base_dir: Path) -> list[str]:
    import datasets

    path = base_dir / str(text_set.dataset)
    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError, FileNotFoundError) as exc:
        raise DataError(f"cannot load dataset {path}: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if len(splits) != 1:
            raise DataError(f"dataset {path} holds splits {', '.join(splits)}; point 'dataset' at one of "
                            f"them, e.g. {text_set.dataset}/{splits[0]}")
        loaded = loaded[splits[0]]
    if text_set.text_column not in loaded.column_names:
        raise DataError(f"dataset {path} has no column '{text_set.text_column}' "
                        f"(columns: {', '.join(loaded.column_names)}); set text_column")
    return [str(t) for t in loaded[text_set.text_column] if t is not None]


def read_texts(text_set: TextSetSpec, base_dir: Path) -> tuple[Any, str]:
    """The documents as an in-memory ``datasets.Dataset`` (column ``text``) and where they came from."""
    import datasets

    base_dir = Path(base_dir)
    if text_set.files is not None:
        files = _files(text_set, base_dir)
        texts = [doc for path in files for doc in _read_file(path, text_set.text_column)]
        where = ", ".join(str(p) for p in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    else:
        texts = _dataset_texts(text_set, base_dir)
        where = str(base_dir / str(text_set.dataset))
    return datasets.Dataset.from_dict({"text": [t for t in texts if t]}), where


def eos_id(tokenizer: Any) -> int | None:
    """The end-of-text id used to join documents, when the tokenizer has one."""
    value = getattr(tokenizer, "eos_token_id", None)
    if isinstance(value, int):
        return value
    to_id = getattr(tokenizer, "token_to_id", None) or getattr(tokenizer, "convert_tokens_to_ids", None)
    unk = getattr(tokenizer, "unk_token_id", None)
    for name in EOS_NAMES:
        found = to_id(name) if to_id else None
        if isinstance(found, int) and found != unk:
            return found
    return None


def tokenize(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids per text, without special tokens; ``tokenizers.Tokenizer`` or transformers tokenizer."""
    if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer
        return [enc.ids for enc in tokenizer.encode_batch(texts, add_special_tokens=False)]
    if callable(tokenizer):  # transformers PreTrainedTokenizer(Fast)
        encoded = tokenizer(texts, add_special_tokens=False, verbose=False)  # no "longer than max" warning
        return [list(ids) for ids in encoded["input_ids"]]
    raise DataError(f"unsupported tokenizer type {type(tokenizer).__name__} "
                    "(expected tokenizers.Tokenizer or a transformers tokenizer)")


def token_stream(text_set: TextSetSpec, tokenizer: Any, base_dir: Path) -> tuple[torch.Tensor, str]:
    """All documents tokenized and concatenated (joined by end-of-text), and where they came from."""
    if tokenizer is None:
        raise DataError("the model has no tokenizer, so text cannot be turned into tokens "
                        "(a factory can return (model, tokenizer))")
    dataset, where = read_texts(text_set, base_dir)
    separator = eos_id(tokenizer)
    ids: list[int] = []
    for row in tokenize(tokenizer, list(dataset["text"])):
        if ids and separator is not None:
            ids.append(separator)
        ids.extend(row)
    return torch.tensor(ids, dtype=torch.long), where


def cut_blocks(stream: torch.Tensor, samples: int, seq_len: int, seed: int, where: str = "text") -> torch.Tensor:
    """``samples`` seeded, non-overlapping ``seq_len`` blocks of a token stream."""
    available = stream.numel() // seq_len
    if available < samples:
        raise DataError(f"{where}: {stream.numel()} tokens make {available} blocks of {seq_len}, but "
                        f"{samples} samples were asked for; add text or lower samples/seq_len")
    chosen = sorted(random.Random(seed).sample(range(available), samples))
    blocks = stream[: available * seq_len].view(available, seq_len)
    return blocks[torch.tensor(chosen, dtype=torch.long)].clone()


def load_blocks(text_set: TextSetSpec, tokenizer: Any, base_dir: Path) -> torch.Tensor:
    """``LongTensor[text_set.samples, text_set.seq_len]``: the text set as model-ready blocks."""
    stream, where = token_stream(text_set, tokenizer, base_dir)
    return cut_blocks(stream, text_set.samples, text_set.seq_len, text_set.seed, where)


def random_blocks(samples: int, seq_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """Deterministic random token ids: prompts when no text is declared (speed only, not quality)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (samples, seq_len), generator=generator, dtype=torch.long)
