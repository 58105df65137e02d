"""Fingerprints for stage keys follow content, not paths or modification times."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from opus.pipeline.fingerprint import fingerprint_source, fingerprint_text_set
from opus.pipeline.spec import TextSetSpec


def test_source_fingerprint_follows_content_not_location(tmp_path: Path) -> None:
    model = tmp_path / "a" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"\x00" * 1000)
    first = fingerprint_source({"hf": "a/model"}, tmp_path)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    os.utime(tmp_path / "b" / "model" / "config.json", (1, 1))
    assert fingerprint_source({"hf": "model"}, tmp_path / "b") == first  # a clone agrees
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    assert fingerprint_source({"hf": "a/model"}, tmp_path) != first


def test_factory_fingerprint_covers_code_and_args() -> None:
    one = fingerprint_source({"factory": "tests.fixtures.tiny:tiny_model", "args": {"width": 8}}, Path("."))
    two = fingerprint_source({"factory": "tests.fixtures.tiny:tiny_model", "args": {"width": 4}}, Path("."))
    assert one != two and len(one) == 64


def test_text_set_fingerprint(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello")
    spec = TextSetSpec(files=["*.txt"], samples=2, seq_len=8)
    first = fingerprint_text_set(spec, tmp_path)
    assert fingerprint_text_set(spec.model_copy(update={"seed": 1}), tmp_path) != first
    (tmp_path / "a.txt").write_text("hello!")
    assert fingerprint_text_set(spec, tmp_path) != first
