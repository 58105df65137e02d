"""examples/smollm2/prepare.py: the text SmolLM2's pipeline measures on (the model itself is downloaded by
`make smollm2-model`, never in the tests)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def _prepare():
    spec = importlib.util.spec_from_file_location("smollm2_prepare", REPO / "examples" / "smollm2" / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_held_out_and_calibration_conversations_share_no_topic(tmp_path: Path) -> None:
    prepare = _prepare()
    held_out, calib = prepare.write_text(tmp_path)
    held = {p.name for p in (tmp_path / "chat" / "heldout").glob("*.txt")}
    cal = {p.name for p in (tmp_path / "chat" / "calib").glob("*.txt")}
    assert (len(held), len(cal)) == (held_out, calib) and held_out > 10 and calib > 3 * held_out - 4
    assert not held & cal
    text = (tmp_path / "chat" / "heldout" / "assert.txt").read_text()
    assert text.startswith("<|im_start|>system\n") and "<|im_start|>assistant\nThe \"assert\" statement" in text
    assert text.endswith("<|im_end|>\n")


def test_the_pipeline_reads_what_prepare_writes() -> None:
    prepare = _prepare()
    spec = yaml.safe_load((REPO / "pipelines" / "smollm2.yaml").read_text())
    assert spec["model"]["gguf"] == f"../.cache/smollm2/{prepare.GGUF}"
    assert "../.cache/smollm2/chat/heldout/*.txt" in spec["data"]["evaluation"]["files"]
    assert "../.cache/smollm2/chat/calib/*.txt" in spec["data"]["calibration"]["files"]


def test_the_harness_tasks_the_pipeline_runs_are_written_from_held_out_text(tmp_path: Path) -> None:
    prepare = _prepare()
    prepare.write_text(tmp_path)
    written = prepare.write_chat_tasks(tmp_path)
    spec = yaml.safe_load((REPO / "pipelines" / "smollm2.yaml").read_text())
    tasks = next(s for s in spec["stages"] if s["id"] == "eval")["with"]["tasks"]
    for task in tasks:
        if task.startswith("../.cache/smollm2/tasks/"):
            assert tmp_path / "tasks" / Path(task).name in written
    held_out = "".join(p.read_text() for p in (tmp_path / "chat" / "heldout").glob("*.txt"))
    first = yaml.safe_load((tmp_path / "tasks" / "chat_next_line.jsonl").read_text().splitlines()[0])
    assert first["context"] in held_out  # held-out text only: the calibration never saw it
