"""Pipelines for the runner's tests, built on the tiny factory model and the fixture stages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from opus.cli.main import main

SCALE = "tests.fixtures.stages.scale"
MEASURE = "tests.fixtures.stages.measure"


def pipeline(stages: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
    return {"name": "t", "model": {"factory": "tests.fixtures.tiny:tiny_model"},
            "run": {"stall_timeout_s": 60}, "stages": stages, **top}


def write_pipeline(path: Path, spec: dict[str, Any] | str) -> Path:
    path.write_text(spec if isinstance(spec, str) else yaml.safe_dump(spec, sort_keys=False))
    return path


def run_cli(*args: str) -> int:
    return main([*map(str, args), "--quiet"] if args[0] in ("run", "resume") else list(map(str, args)))


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def statuses(run_dir: Path) -> dict[str, str]:
    return {s["id"]: s["status"] for s in summary(run_dir)["stages"]}


def events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def save_word_tokenizer(model_dir: Path, words: list[str]) -> int:
    """A word-level tokenizer over ``words`` saved as transformers does; returns the vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="[UNK]").save_pretrained(
        model_dir)
    return len(vocab)
