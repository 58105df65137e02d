"""Task files written from text, read by path from anywhere, and the shipped K3 tasks kept current."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opus.errors import InputError
from opus.harness.tasks import task_entry, write_tasks
from tests.conftest import REPO

HELD_OUT = sorted((REPO / "examples" / "k3" / "data" / "heldout").glob("*.txt"))
SHIPPED = REPO / "examples" / "k3" / "tasks"


def _docs(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_written_tasks_hold_the_real_text(tmp_path: Path) -> None:
    written = write_tasks(HELD_OUT[:6], tmp_path, "x", samples=20, seed=3)
    assert [p.name for p in written] == ["x_next_line.yaml", "x_word_order.yaml", "x_line_end.yaml"]
    text = "\n".join(p.read_text() for p in HELD_OUT[:6])
    for name in ("x_next_line", "x_word_order"):
        docs = _docs(tmp_path / f"{name}.jsonl")
        assert len(docs) == 20
        for doc in docs:
            real = doc["choices"][doc["label"]]
            assert len(set(doc["choices"])) == 4 and doc["context"] + real + "\n" in text + "\n"
    for doc in _docs(tmp_path / "x_line_end.jsonl"):
        assert doc["target"] and "\n" not in doc["target"] and doc["context"] + doc["target"] in text


def test_the_same_seed_writes_the_same_bytes_and_the_shipped_tasks_are_current(tmp_path: Path) -> None:
    write_tasks(HELD_OUT, tmp_path, "k3", samples=100, seed=0)
    for shipped in sorted(SHIPPED.iterdir()):
        assert (tmp_path / shipped.name).read_bytes() == shipped.read_bytes(), (
            f"{shipped} is stale: opus tasks examples/k3/data/heldout/*.txt --out examples/k3/tasks --name k3")


def test_a_task_file_by_path_has_its_data_resolved_against_its_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = task_entry("k3_next_line.yaml", SHIPPED)
    assert config["task"] == "k3_next_line"
    assert config["dataset_kwargs"]["data_files"]["test"] == str(SHIPPED / "k3_next_line.jsonl")
    assert task_entry("hellaswag", SHIPPED) == "hellaswag"  # a name is the harness's own


@pytest.mark.parametrize(("text", "words"), [
    ("task: t\nprocess_docs: !function utils.process\n", "a tag Opus does not run"),
    ("- just\n- a list\n", "a mapping with a 'task' name"),
    ("task: [unclosed\n", "not a task file"),
    ("task: t\ndoc_to_text: \"{{ ''.__class__.__mro__[1].__subclasses__() }}\"\n", "reaches Python's internals"),
])
def test_a_task_file_that_would_run_code_or_is_not_one_is_one_line(tmp_path: Path, text: str, words: str) -> None:
    (tmp_path / "t.yaml").write_text(text)
    with pytest.raises(InputError) as error:
        task_entry("t.yaml", tmp_path)
    assert words in str(error.value) and "\n" not in str(error.value) and "t.yaml" in str(error.value)
    with pytest.raises(InputError, match="no such task file"):
        task_entry("missing.yaml", tmp_path)
