"""The Python API: ``opus.run`` runs smoke.yaml as ``opus run`` does, ``opus.load`` loads what it made
(from the run directory and from the export directory, moved, its source model gone) and
``generate`` continues text greedily exactly as the model's own argmax does; nothing the run writes
for git or for export holds an absolute path."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import opus
from opus.atomic import relative_path
from opus.errors import InputError
from tests.helpers import run_cli, statuses

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "pipelines" / "smoke.yaml"
K3 = REPO / "examples" / "k3" / "model"
# smoke.yaml's model, data and workload, two quick stages: a model-changing one (its recipe replays
# on load) and the native export (ONNX, HF and GGUF off: tests/export covers them).
STAGES = [{"id": "fuse", "uses": "fuse", "with": {"measure_time": False, "experts": {"choose": False}}},
          {"id": "export", "uses": "export", "needs": ["fuse"], "with": {"onnx": False, "hf": False, "gguf": False}}]
PROMPT = "def main():\n"


@dataclass
class ApiRun:
    root: Path
    model_dir: Path
    run_dir: Path
    summary: dict
    stdout: str


@pytest.fixture(scope="module")
def api_run(tmp_path_factory: pytest.TempPathFactory) -> ApiRun:
    root = tmp_path_factory.mktemp("api")
    model_dir = shutil.copytree(K3, root / "models" / "k3")  # a copy: a test renames it away
    run_dir = root / "runs" / "smoke"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = opus.run(SMOKE, set={"model.hf": relative_path(model_dir, SMOKE.parent), "stages": STAGES},
                           run_dir=run_dir, quiet=True)
    return ApiRun(root, model_dir, run_dir, summary, out.getvalue())


def _greedy_argmax(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """The model's own greedy continuation: a full forward per token, no cache, argmax."""
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[0, len(ids):].tolist()


def test_import_opus_stays_light() -> None:
    code = "import sys, opus; assert callable(opus.run) and callable(opus.load); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", "import sys, opus; print('torch' in sys.modules)"],
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, check=False).returncode == 0
    assert {"run", "load"} <= set(dir(opus))


def test_run_returns_the_summary_and_names_the_export(api_run: ApiRun) -> None:
    assert api_run.summary["status"] == "finished", api_run.summary.get("reasons")
    assert api_run.summary == json.loads((api_run.run_dir / "summary.json").read_text())
    assert statuses(api_run.run_dir) == {"fuse": "done", "export": "done"}
    (export_dir,) = (api_run.run_dir / "stages").glob("*-export/artifacts/export")
    last = api_run.stdout.strip().splitlines()[-1].split()
    assert last[0] == "exported" and Path(last[1]).resolve() == export_dir.resolve()


def test_nothing_written_for_git_or_export_holds_an_absolute_path(api_run: ApiRun) -> None:
    from opus.report.publish import tracked_files

    (export_dir,) = (api_run.run_dir / "stages").glob("*-export/artifacts/export")
    files = [*tracked_files(api_run.run_dir), *export_dir.glob("*.json")]
    names = {p.name for p in files}
    assert {"run.json", "summary.json", "events.jsonl", "checkpoints.json", "report.md", "pipeline.yaml",
            "opus-export.json"} <= names
    for path in files:
        text = path.read_text(errors="replace")
        for absolute in {str(REPO), str(api_run.root), str(api_run.root.resolve())}:
            # Not the tail of a relative path ("../../work/main/pipelines"): a path starting there.
            assert not re.search(r"(?<!\.)" + re.escape(absolute), text), f"{path.name} holds {absolute}"
    info = json.loads((api_run.run_dir / "run.json").read_text())
    assert (api_run.run_dir / info["base_dir"]).resolve() == SMOKE.parent
    assert (api_run.run_dir / info["pipeline"]).resolve() == SMOKE


def test_load_the_run_and_generate_greedily_through_its_cache(api_run: ApiRun) -> None:
    lm = opus.load(api_run.run_dir)
    assert lm.path.name == "export" and lm.tokenizer is not None
    assert [step["kind"] for step in lm.state["recipe"]] == ["fuse"]
    ids = lm.encode(PROMPT)
    assert lm.generate_ids([ids], 12)[0] == _greedy_argmax(lm.model, ids, 12)
    text = lm.generate(PROMPT, max_new_tokens=12, stop_at_eos=False)
    assert isinstance(text, str) and text == lm.tokenizer.decode(_greedy_argmax(lm.model, ids, 12),
                                                                 skip_special_tokens=True)
    prompts = ["import os\n", PROMPT, "class A:\n"]  # lengths differ: batched by length, order kept
    assert lm.generate(prompts, max_new_tokens=6) == [lm.generate(p, max_new_tokens=6) for p in prompts]
    sampled = lm.generate(PROMPT, max_new_tokens=6, temperature=0.8, seed=1)
    assert sampled == lm.generate(PROMPT, max_new_tokens=6, temperature=0.8, seed=1)


def test_resume_and_verify_read_the_relative_run_files(api_run: ApiRun) -> None:
    assert run_cli("verify", api_run.run_dir) == 0
    again = opus.run(SMOKE, set={"model.hf": relative_path(api_run.model_dir, SMOKE.parent), "stages": STAGES},
                     run_dir=api_run.run_dir, quiet=True)
    assert again["status"] == "finished" and set(statuses(api_run.run_dir).values()) == {"cached"}


def test_moved_export_loads_without_the_source_model(api_run: ApiRun, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (export_dir,) = (api_run.run_dir / "stages").glob("*-export/artifacts/export")
    expected = opus.load(export_dir).generate(PROMPT, max_new_tokens=8)
    shipped = shutil.copytree(export_dir, tmp_path / "shipped" / "k3-smoke")
    gone = api_run.model_dir.rename(api_run.model_dir.with_name("k3-gone"))
    try:
        monkeypatch.chdir(tmp_path)  # nothing resolves against the directory the run was started from either
        lm = opus.load(shipped)
        assert lm.generate(PROMPT, max_new_tokens=8) == expected
        assert opus.load(api_run.run_dir).generate(PROMPT, max_new_tokens=8) == expected
    finally:
        gone.rename(api_run.model_dir)


def test_errors_are_the_cli_ones_raised(api_run: ApiRun, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no stage with id 'nope'"):
        opus.run(SMOKE, set=["stages.nope.with.x=1"], run_dir=tmp_path / "never")
    with pytest.raises(InputError, match="unknown key"):
        opus.run(SMOKE, set={"workload.batch_sise": 2}, run_dir=tmp_path / "never")
    assert not (tmp_path / "never").exists()
    with pytest.raises(InputError, match="not an export directory"):
        opus.load(tmp_path)


def test_load_a_run_without_export_gives_its_final_checkpoint(tmp_path: Path) -> None:
    from opus.bench.target import resolve_target
    from tests.helpers import SCALE, pipeline, write_pipeline
    from tests.stages.test_export import tiny_llama

    spec = pipeline([{"id": "scale", "uses": SCALE, "with": {"factor": 1.5}}],
                    model={"factory": "tests.stages.test_export:tiny_llama"})
    path = write_pipeline(tmp_path / "p.yaml", spec)
    assert opus.run(path, run_dir=tmp_path / "run", quiet=True)["status"] == "finished"
    # Its pipeline.yaml names a factory, code: a run (or one of its checkpoints) loads it only when trusted.
    with pytest.raises(InputError, match="factory is the function 'tests.stages.test_export:tiny_llama'"):
        opus.load(tmp_path / "run")
    with pytest.raises(InputError, match="pass trust_code=True"):
        opus.load(tmp_path / "run" / "stages" / "00-scale")
    lm = opus.load(tmp_path / "run", trust_code=True)
    assert lm.path.resolve() == (tmp_path / "run" / "stages" / "00-scale").resolve() and lm.tokenizer is None
    ids = [3, 1, 4, 1, 5]
    assert lm.generate_ids([ids], 5)[0] == _greedy_argmax(lm.model, ids, 5)
    with torch.no_grad():
        assert not torch.equal(lm.model(torch.tensor([ids])), tiny_llama()(torch.tensor([ids])))  # scaled
    with pytest.raises(InputError, match="no tokenizer"):
        lm.generate("text")
    # A state.json edited by hand (here to drop the scaled tensors) no longer matches the manifest's
    # sha256: it must not load as the run's model, and `opus resume` redoes the stage, after which the run loads again.
    state = tmp_path / "run" / "stages" / "00-scale" / "state.json"
    state.write_text(state.read_text().replace('"tensors.safetensors"', "null"))  # would load unscaled
    with pytest.raises(InputError, match=r"00-scale: the checkpoint is damaged \(state.json does not match"):
        opus.load(tmp_path / "run")
    with pytest.raises(InputError, match="00-scale: the checkpoint is damaged"):
        resolve_target(tmp_path / "run", tmp_path)  # nor is it what `opus bench` measures
    assert run_cli("resume", tmp_path / "run") == 0
    assert opus.load(tmp_path / "run", trust_code=True).generate_ids([ids], 5)[0] == _greedy_argmax(lm.model, ids, 5)


def test_eager_load_runs_the_chosen_cache_without_compiling() -> None:
    from opus.api import LoadedModel
    from opus.kv.choice import kv_cache_step

    static = {"kind": "static", "provider": "opus.kv.static", "compile": True, "slot_multiple": 128}
    state = {"recipe": [{"kind": "fuse"}, kv_cache_step(static)]}
    assert LoadedModel(None, None, state, Path("x")).kv_cache == static
    assert LoadedModel(None, None, state, Path("x"), eager=True).kv_cache == {**static, "compile": False}
    assert LoadedModel(None, None, {"recipe": []}, Path("x"), eager=True).kv_cache is None
