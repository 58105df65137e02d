"""Text sets: files, jsonl and saved datasets -> seeded token blocks; clear errors; fingerprints."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from opus.pipeline.fingerprint import fingerprint_text_set
from opus.pipeline.spec import TextSetSpec
from opus.runtime.data import DataError, check_enough_text, eos_id, load_blocks, random_blocks, token_stream

WORDS = [f"w{i}" for i in range(40)]


def word_tokenizer() -> Tokenizer:
    vocab = {"[UNK]": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def doc(seed: int, words: int = 60) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (words,), generator=g).tolist())


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "data").mkdir()
    for i in range(3):
        (tmp_path / "data" / f"part{i}.txt").write_text(doc(i))
    return tmp_path


def spec(**kw) -> TextSetSpec:
    return TextSetSpec(**{"files": ["data/*.txt"], "samples": 4, "seq_len": 16, **kw})


def test_blocks_are_deterministic_and_come_from_the_text(corpus) -> None:
    tok = word_tokenizer()
    blocks = load_blocks(spec(), tok, corpus)
    assert blocks.shape == (4, 16) and blocks.dtype == torch.long
    assert torch.equal(load_blocks(spec(), tok, corpus), blocks)
    assert not torch.equal(load_blocks(spec(seed=1), tok, corpus), blocks)
    stream, _ = token_stream(spec(), tok, corpus)
    assert stream.numel() == 3 * 60 + 2  # documents joined by one end-of-text token
    rows = {tuple(stream[i : i + 16].tolist()) for i in range(0, stream.numel() - 15, 16)}
    assert all(tuple(row.tolist()) in rows for row in blocks)


def test_transformers_tokenizer_gives_the_same_blocks(corpus) -> None:
    from transformers import PreTrainedTokenizerFast

    raw = word_tokenizer()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", unk_token="[UNK]")
    assert eos_id(raw) == eos_id(wrapped) == 1
    assert torch.equal(load_blocks(spec(), wrapped, corpus), load_blocks(spec(), raw, corpus))


def test_saved_dataset_and_jsonl_match_the_files(corpus) -> None:
    import datasets

    texts = [doc(i) for i in range(3)]
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(corpus / "ds"))
    with open(corpus / "docs.jsonl", "w") as fh:
        fh.writelines(json.dumps({"body": t}) + "\n" for t in texts)
    tok = word_tokenizer()
    expected = load_blocks(spec(), tok, corpus)
    from_disk = TextSetSpec(dataset="ds", text_column="body", samples=4, seq_len=16)
    assert torch.equal(load_blocks(from_disk, tok, corpus), expected)
    assert torch.equal(load_blocks(spec(files=["docs.jsonl"], text_column="body"), tok, corpus), expected)


def test_dataset_errors_name_the_problem(corpus) -> None:
    import datasets

    ds = datasets.Dataset.from_dict({"text": [doc(0)]})
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(corpus / "dd"))
    tok = word_tokenizer()
    with pytest.raises(DataError, match="splits train, test.*dd/train"):
        load_blocks(TextSetSpec(dataset="dd"), tok, corpus)
    assert load_blocks(TextSetSpec(dataset="dd/train", samples=2, seq_len=16), tok, corpus).shape == (2, 16)
    with pytest.raises(DataError, match="no column 'body'.*columns: text"):
        load_blocks(TextSetSpec(dataset="dd/train", text_column="body"), tok, corpus)


def test_split_names_one_split_of_a_dataset_dict(corpus) -> None:
    import datasets

    ds = datasets.Dataset.from_dict({"text": [doc(0)]})
    datasets.DatasetDict({"train": ds, "test": datasets.Dataset.from_dict({"text": [doc(1)]})}).save_to_disk(
        str(corpus / "dd"))
    ds.save_to_disk(str(corpus / "single"))
    tok = word_tokenizer()
    blocks = load_blocks(TextSetSpec(dataset="dd", split="train", samples=2, seq_len=16), tok, corpus)
    assert torch.equal(blocks, load_blocks(TextSetSpec(dataset="dd/train", samples=2, seq_len=16), tok, corpus))
    with pytest.raises(DataError, match="no split 'validation' \\(splits: train, test\\)") as info:
        load_blocks(TextSetSpec(dataset="dd", split="validation"), tok, corpus)
    assert info.value.key == "split"
    with pytest.raises(DataError, match="a single Dataset, not splits; remove split"):
        load_blocks(TextSetSpec(dataset="single", split="train"), tok, corpus)
    with pytest.raises(ValueError, match="split names a split of a dataset"):
        TextSetSpec(files=["data/*.txt"], split="train")


def test_binary_and_empty_text_are_refused(corpus) -> None:
    (corpus / "blob.bin").write_bytes(b"w1 w2\x00\x01")
    with pytest.raises(DataError, match=r"blob\.bin: a binary file, not text \(NUL byte at offset 5\)"):
        load_blocks(spec(files=["blob.bin"]), word_tokenizer(), corpus)
    (corpus / "empty.txt").write_text("")
    with pytest.raises(DataError, match=r"empty\.txt: no text") as info:
        load_blocks(spec(files=["empty.txt"]), word_tokenizer(), corpus)
    assert info.value.key == "files"


def test_check_enough_text_agrees_with_load_blocks(corpus) -> None:
    tok = word_tokenizer()
    assert check_enough_text(spec(samples=11), tok, corpus, chunk=1) >= 11 * 16
    with pytest.raises(DataError, match="182 tokens make 11 blocks of 16, but 12 samples") as info:
        check_enough_text(spec(samples=12), tok, corpus, chunk=1)
    assert info.value.key == "samples"


def test_too_few_tokens_names_the_file(corpus) -> None:
    with pytest.raises(DataError, match=r"part0\.txt.*182 tokens make 11 blocks of 16, but 12 samples"):
        load_blocks(spec(samples=12), word_tokenizer(), corpus)


def test_unreadable_files_and_missing_tokenizers_are_clear(corpus) -> None:
    (corpus / "data" / "part9.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(DataError, match=r"cannot read .*part9\.txt"):
        load_blocks(spec(), word_tokenizer(), corpus)
    with pytest.raises(DataError, match="no file matches 'nothing/\\*.txt'"):
        load_blocks(spec(files=["nothing/*.txt"]), word_tokenizer(), corpus)
    with pytest.raises(DataError, match="no tokenizer"):
        load_blocks(spec(), None, corpus)
    (corpus / "bad.jsonl").write_text('{"text": "w1"}\n{oops\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid JSON"):
        load_blocks(spec(files=["bad.jsonl"]), word_tokenizer(), corpus)


def test_fingerprint_changes_when_a_file_changes(corpus) -> None:
    before = fingerprint_text_set(spec(), corpus)
    assert fingerprint_text_set(spec(), corpus) == before
    (corpus / "data" / "part1.txt").write_text(doc(1) + " w3")
    assert fingerprint_text_set(spec(), corpus) != before


def test_random_blocks_are_seeded() -> None:
    a = random_blocks(3, 8, 50, seed=4)
    assert a.shape == (3, 8) and int(a.max()) < 50
    assert torch.equal(a, random_blocks(3, 8, 50, seed=4))
    assert not torch.equal(a, random_blocks(3, 8, 50, seed=5))


# -- dataset: data files and the hub cache ----------------------------------------------------------
def test_a_directory_of_txt_files_is_the_same_text_as_the_files(corpus, monkeypatch) -> None:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", corpus / "home-cache")
    tok = word_tokenizer()
    expected = load_blocks(spec(), tok, corpus)
    assert torch.equal(load_blocks(TextSetSpec(dataset="data", samples=4, seq_len=16), tok, corpus), expected)
    assert not (corpus / "home-cache").exists()  # prepared in a temporary cache, not the user's


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "csv"])
def test_data_files_with_splits_inferred_from_their_names(corpus, kind) -> None:
    import datasets

    train = datasets.Dataset.from_dict({"body": [doc(i) for i in range(3)], "n": [0, 1, 2]})
    test = datasets.Dataset.from_dict({"body": [doc(7)], "n": [7]})
    root = corpus / "files"
    (root / "data").mkdir(parents=True)
    for name, part in (("train", train), ("test", test)):
        target = str(root / "data" / f"{name}-00000-of-00001.{kind}")
        {"parquet": part.to_parquet, "jsonl": part.to_json, "csv": part.to_csv}[kind](target)
    (root / "README.md").write_text("# a dataset card, not data\n")
    tok = word_tokenizer()
    with pytest.raises(DataError, match=r"holds splits train, test; name one with split: train$") as info:
        load_blocks(TextSetSpec(dataset="files", text_column="body"), tok, corpus)
    assert info.value.key == "dataset"
    got = load_blocks(TextSetSpec(dataset="files", split="train", text_column="body", samples=4, seq_len=16), tok,
                      corpus)
    assert torch.equal(got, load_blocks(spec(), tok, corpus))
    with pytest.raises(DataError, match="no split 'validation'"):
        load_blocks(TextSetSpec(dataset="files", split="validation", text_column="body"), tok, corpus)
    with pytest.raises(DataError, match="no column 'text'.*columns: body, n") as info:
        load_blocks(TextSetSpec(dataset="files", split="test"), tok, corpus)
    assert info.value.key == "text_column"
    one = TextSetSpec(dataset=f"files/data/train-00000-of-00001.{kind}", text_column="body", samples=4, seq_len=16)
    assert torch.equal(load_blocks(one, tok, corpus), got)  # one data file: its only split


def test_data_file_directories_that_cannot_be_read(corpus) -> None:
    (corpus / "mixed").mkdir()
    (corpus / "mixed" / "a.csv").write_text("text\nw1 w2\n")
    (corpus / "mixed" / "b.txt").write_text("w1 w2")
    with pytest.raises(DataError, match="mixes csv and text files; point dataset at") as info:
        load_blocks(TextSetSpec(dataset="mixed"), word_tokenizer(), corpus)
    assert info.value.key == "dataset" and "\n" not in str(info.value)
    (corpus / "nothing").mkdir()
    (corpus / "nothing" / "notes.md").write_text("no data here")
    with pytest.raises(DataError, match="neither a dataset saved with save_to_disk nor a directory of data files"):
        load_blocks(TextSetSpec(dataset="nothing"), word_tokenizer(), corpus)
    (corpus / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"cannot read dataset .*broken\.parquet as parquet files: ") as info:
        load_blocks(TextSetSpec(dataset="broken.parquet"), word_tokenizer(), corpus)
    assert "\n" not in str(info.value)


def test_a_hub_dataset_is_read_from_the_local_cache(corpus, monkeypatch) -> None:
    import datasets

    cache = corpus / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(DataError) as info:
        load_blocks(TextSetSpec(dataset="some-org/corpus"), word_tokenizer(), corpus)
    assert info.value.key == "dataset" and str(cache) in str(info.value) and "\n" not in str(info.value)
    assert "hf download some-org/corpus --repo-type dataset" in str(info.value)
    repo = cache / "datasets--some-org--corpus"
    (repo / "snapshots" / "c0ffee" / "data").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee")
    (repo / "snapshots" / "c0ffee" / ".gitattributes").write_text("*.parquet filter=lfs\n")
    datasets.Dataset.from_dict({"text": [doc(i) for i in range(3)]}).to_parquet(
        str(repo / "snapshots" / "c0ffee" / "data" / "train-00000-of-00001.parquet"))
    tok = word_tokenizer()
    hub = TextSetSpec(dataset="some-org/corpus", samples=4, seq_len=16)
    assert torch.equal(load_blocks(hub, tok, corpus), load_blocks(spec(), tok, corpus))
    before = fingerprint_text_set(hub, corpus)
    datasets.Dataset.from_dict({"text": [doc(9)]}).to_parquet(
        str(repo / "snapshots" / "c0ffee" / "data" / "train-00000-of-00001.parquet"))
    assert fingerprint_text_set(hub, corpus) != before  # the snapshot's content is in the stage keys
