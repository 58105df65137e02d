"""Calibration and evaluation text: declared once in the pipeline, tokenized by each model's tokenizer.

A text set (``opus.runtime.text_set.TextSetSpec``) is either files/globs relative to the pipeline's directory
(each file one document; ``.jsonl`` files one JSON object per line, text in ``text_column``) or a
``dataset:``, one of (of several splits, the one named by ``split``; the text in ``text_column``):

- a directory written by ``datasets``' ``save_to_disk`` (``load_from_disk``);
- a directory of data files, or one data file: parquet, json / jsonl, csv or txt (each .txt file one
  document), read by ``datasets.load_dataset(<builder>, data_files=...)`` with the splits ``datasets``
  infers from the file names (``train-*.parquet``, ``data/test/...``; else all files are ``train``);
- a Hugging Face dataset id (``org/name``, or ``name``) in the local hub cache (opus.models.hub;
  ``datasets--org--name/snapshots/<commit>``, what ``hf download --repo-type dataset`` fills), read as a
  directory of data files. Nothing is downloaded: one absent from the cache is one line naming the cache.
Files must be UTF-8 text: a NUL byte marks a binary file, and a set without any text is refused.
Documents are tokenized with the model's own tokenizer (a ``tokenizers.Tokenizer`` or a
transformers tokenizer), joined with the end-of-text token when the tokenizer has one, cut into
non-overlapping ``seq_len`` blocks, and ``samples`` blocks are drawn with a seeded
``random.Random`` (stable across Python and torch versions).

Everything stays in memory: nothing is written to the ``datasets`` cache in the home directory (data
files are prepared in a temporary cache, removed once their text is read) and nothing needs the
network. Fingerprints for stage keys: ``opus.pipeline.fingerprint.fingerprint_text_set``.
"""

from __future__ import annotations

import glob
import json
import random
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from opus.errors import OpusError
from opus.runtime.text_set import TextSetSpec

EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


class DataError(OpusError):
    """A text set cannot be read or is too small; the message names the file or dataset.

    ``key`` is the text set's key the problem is about (``files``, ``dataset``, ``split``,
    ``text_column``, ``samples``), so that a check before the run can point at its line.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


def _files(text_set: TextSetSpec, base_dir: Path) -> list[Path]:
    paths: list[Path] = []
    for pattern in text_set.files or []:
        matched = sorted(Path(p) for p in glob.glob(str(base_dir / pattern), recursive=True))
        matched = [p for p in matched if p.is_file()]
        if not matched:
            raise DataError(f"no file matches '{pattern}' (relative to {base_dir})", key="files")
        paths.extend(p for p in matched if p not in paths)
    return paths


def _read_file(path: Path, column: str) -> list[str]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc}", key="files") from None
    # NUL never occurs in text but decodes as UTF-8: without this a binary file would become tokens.
    if (nul := raw.find(b"\0")) >= 0:
        raise DataError(f"cannot read {path}: a binary file, not text (NUL byte at offset {nul})", key="files")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"cannot read {path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})",
                        key="files") from None
    if path.suffix != ".jsonl":
        return [text]
    docs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{number}: invalid JSON: {exc}", key="files") from None
        if not isinstance(record, dict) or column not in record:
            raise DataError(f"{path}:{number}: no '{column}' field (set text_column)", key="text_column")
        docs.append(str(record[column]))
    return docs


def _dataset_split(loaded: Any, text_set: TextSetSpec, path: Path) -> Any:
    """The one Dataset a text set means: a Dataset as is, or the DatasetDict's ``split``."""
    import datasets

    if not isinstance(loaded, datasets.DatasetDict):
        if text_set.split is not None:
            raise DataError(f"dataset {path} is a single Dataset, not splits; remove split", key="split")
        return loaded
    splits = list(loaded)
    if text_set.split is not None:
        if text_set.split not in loaded:
            raise DataError(f"dataset {path} has no split '{text_set.split}' (splits: {', '.join(splits)})",
                            key="split")
        return loaded[text_set.split]
    if len(splits) != 1:
        also = f" (or point dataset at {text_set.dataset}/{splits[0]})" if _is_saved(path / splits[0]) else ""
        raise DataError(f"dataset {path} holds splits {', '.join(splits)}; name one with split: {splits[0]}{also}",
                        key="dataset")
    return loaded[splits[0]]


# Data-file suffix -> the ``datasets`` builder that reads it.
BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text"}
# Files a dataset repository holds beside its data: never data, whatever their suffix.
_NOT_DATA = {"dataset_infos.json", "dataset_info.json", "dataset_dict.json", "state.json"}
_DATASET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


def resolve_dataset(value: str, base_dir: Path) -> Path:
    """The path a ``dataset:`` value means: a path relative to ``base_dir`` when it exists, else a hub
    dataset id's snapshot in the local Hugging Face cache; neither is a DataError naming both."""
    from opus.models.hub import cached_snapshot, looks_like_hub_id, not_cached

    local = Path(base_dir) / Path(value).expanduser()
    if local.exists():
        return local
    if not (looks_like_hub_id(value) or _DATASET_NAME.fullmatch(value)):
        raise DataError(f"dataset {local} does not exist", key="dataset")
    snapshot = cached_snapshot(value, repo_type="dataset")
    if snapshot is None:
        raise DataError(not_cached(value, local, repo_type="dataset"), key="dataset")
    return snapshot


def _is_saved(path: Path) -> bool:
    """A directory ``save_to_disk`` wrote: a Dataset's state.json or a DatasetDict's dataset_dict.json."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def _data_files(path: Path) -> tuple[str, dict[str, list[str]]]:
    """The builder and the split -> files of a data file, or of a directory of them (splits as ``datasets``
    infers them from the names, each kept to the files of the one builder)."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    if path.is_file():
        if path.suffix not in BUILDERS:
            raise DataError(f"dataset {path}: not a data file ({', '.join(BUILDERS)})", key="dataset")
        return BUILDERS[path.suffix], {"train": [str(path)]}
    found = [p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in BUILDERS and p.name not in _NOT_DATA
             and not any(part.startswith(".") for part in p.relative_to(path).parts)]
    kinds = sorted({BUILDERS[p.suffix] for p in found})
    if not kinds:
        raise DataError(f"dataset {path}: neither a dataset saved with save_to_disk nor a directory of data files "
                        f"({', '.join(BUILDERS)})", key="dataset")
    if len(kinds) > 1:
        raise DataError(f"dataset {path} mixes {' and '.join(kinds)} files; point dataset at the directory (or file) "
                        "of one kind", key="dataset")
    keep = {str(p.resolve()) for p in found}
    inferred = DataFilesDict.from_patterns(get_data_patterns(str(path)), base_path=str(path))
    splits = {str(split): [f for f in files if str(Path(f).resolve()) in keep] for split, files in inferred.items()}
    return kinds[0], {split: files for split, files in splits.items() if files} or {"train": sorted(keep)}


@contextmanager
def _opened(path: Path) -> Iterator[Any]:
    """The Dataset or DatasetDict at ``path``; data files are prepared in a temporary cache."""
    import datasets

    if _is_saved(path):
        try:
            saved = datasets.load_from_disk(str(path))
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot load dataset {path}: {exc}", key="dataset") from None
        yield saved
        return
    builder, files = _data_files(path)
    options = {"sample_by": "document"} if builder == "text" else {}  # one .txt file, one document (as files:)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="opus-datasets-") as cache:
            try:
                loaded = datasets.load_dataset(builder, data_files=files, cache_dir=cache, **options)
            except Exception as exc:  # noqa: BLE001 - pyarrow and the builders raise anything
                raise DataError(f"cannot read dataset {path} as {builder} files: {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''}", key="dataset") from None
            yield loaded
    finally:
        if bars:
            datasets.enable_progress_bars()


def _dataset_texts(text_set: TextSetSpec, base_dir: Path) -> list[str]:
    path = resolve_dataset(str(text_set.dataset), base_dir)
    with _opened(path) as loaded:
        dataset = _dataset_split(loaded, text_set, path)
        if text_set.text_column not in dataset.column_names:
            raise DataError(f"dataset {path} has no column '{text_set.text_column}' "
                            f"(columns: {', '.join(dataset.column_names)}); set text_column", key="text_column")
        return [str(t) for t in dataset[text_set.text_column] if t is not None]


def documents(text_set: TextSetSpec, base_dir: Path) -> tuple[list[str], str]:
    """The non-empty documents of a text set and where they came from; no text at all is an error."""
    base_dir = Path(base_dir)
    if text_set.files is not None:
        files = _files(text_set, base_dir)
        docs = [doc for path in files for doc in _read_file(path, text_set.text_column)]
        where = ", ".join(str(p) for p in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    else:
        docs = _dataset_texts(text_set, base_dir)
        where = str(base_dir / str(text_set.dataset))
    docs = [d for d in docs if d]
    if not docs:  # tokenizing nothing fails far from here (an IndexError deep in a tokenizer)
        raise DataError(f"{where}: no text (empty)", key="files" if text_set.files is not None else "dataset")
    return docs, where


def read_texts(text_set: TextSetSpec, base_dir: Path) -> tuple[Any, str]:
    """The documents as an in-memory ``datasets.Dataset`` (column ``text``) and where they came from."""
    import datasets

    docs, where = documents(text_set, base_dir)
    return datasets.Dataset.from_dict({"text": docs}), where


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


def _too_few(where: str, tokens: int, samples: int, seq_len: int) -> DataError:
    return DataError(f"{where}: {tokens} tokens make {tokens // seq_len} blocks of {seq_len}, but {samples} "
                     "samples were asked for; add text or lower samples/seq_len", key="samples")


def check_enough_text(text_set: TextSetSpec, tokenizer: Any, base_dir: Path, chunk: int = 64) -> int:
    """Raise what ``load_blocks`` would raise for too little text, tokenizing only as much as it takes.

    Returns the tokens counted (at least ``samples * seq_len``): a check before a run stays quick
    however large the text set is.
    """
    docs, where = documents(text_set, base_dir)
    needed = text_set.samples * text_set.seq_len
    separator = eos_id(tokenizer)
    count = 0
    for start in range(0, len(docs), chunk):
        for row in tokenize(tokenizer, docs[start : start + chunk]):
            count += len(row) + (1 if count and separator is not None else 0)  # as token_stream joins
        if count >= needed:
            return count
    raise _too_few(where, count, text_set.samples, text_set.seq_len)


def cut_blocks(stream: torch.Tensor, samples: int, seq_len: int, seed: int, where: str = "text") -> torch.Tensor:
    """``samples`` seeded, non-overlapping ``seq_len`` blocks of a token stream."""
    available = stream.numel() // seq_len
    if available < samples:
        raise _too_few(where, stream.numel(), samples, seq_len)
    chosen = sorted(random.Random(seed).sample(range(available), samples))
    blocks = stream[: available * seq_len].view(available, seq_len)
    return blocks[torch.tensor(chosen, dtype=torch.long)].clone()


def load_blocks(text_set: TextSetSpec, tokenizer: Any, base_dir: Path) -> torch.Tensor:
    """``LongTensor[text_set.samples, text_set.seq_len]``: the text set as model-ready blocks."""
    stream, where = token_stream(text_set, tokenizer, base_dir)
    return cut_blocks(stream, text_set.samples, text_set.seq_len, text_set.seed, where)


def tiled(blocks: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """``blocks [N, T]`` repeated along both axes and cut to ``[rows, length]`` (prompts of a workload's
    shape from fewer or shorter blocks of text)."""
    n, t = blocks.shape
    return blocks.repeat(-(-rows // n), -(-length // t))[:rows, :length].contiguous()


def random_blocks(samples: int, seq_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """Deterministic random token ids: prompts when no text is declared (speed only, not quality)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (samples, seq_len), generator=generator, dtype=torch.long)
