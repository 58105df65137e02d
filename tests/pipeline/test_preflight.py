"""Checks before anything runs (opus.pipeline.preflight): each bad input is one line naming file, line, key; exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from opus.cli.main import main

WORDS = [f"w{i}" for i in range(40)]
PIPELINE = """\
name: pf
model:
  hf: model
  device: cpu
data:
  evaluation: {files: ["data/*.txt"], samples: 4, seq_len: 32}
stages:
  - id: baseline
    uses: baseline
  - id: check
    uses: eval
    needs: baseline
    gate:
      agreement: {min: 0.9}
      ppl: {max_increase: 0.05}
"""


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pipeline directory: a tiny Llama saved by transformers, a word-level tokenizer and some text."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers import save_word_tokenizer

    root = tmp_path_factory.mktemp("project")
    vocab_size = save_word_tokenizer(root / "model", WORDS)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(root / "model")
    (root / "data").mkdir()
    for part in range(2):
        (root / "data" / f"part{part}.txt").write_text(" ".join(WORDS[(7 * i + part) % 40] for i in range(150)))
    (root / "p.yaml").write_text(PIPELINE)
    return root


@pytest.fixture
def project(template: Path, tmp_path: Path) -> Path:
    """A copy each test may damage."""
    return Path(shutil.copytree(template, tmp_path / "project"))


def check(capsys: pytest.CaptureFixture, path: Path, *extra: str, command: str = "check") -> str:
    """Run the CLI, expect exit 2 and one line without a traceback; return that line."""
    assert main([command, str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def edit(path: Path, old: str, new: str) -> Path:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    return path


def test_a_good_project_passes(project: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["check", str(project / "p.yaml")]) == 0
    assert "valid; stages in order: baseline → check" in capsys.readouterr().out


# -- gates -------------------------------------------------------------------------------------
def test_misspelt_gate_metric_names_the_closest(project: Path, capsys: pytest.CaptureFixture) -> None:
    edit(project / "p.yaml", "agreement: {min", "agrement: {min")
    err = check(capsys, project / "p.yaml")
    assert f"{project}/p.yaml:14: stages[1].gate.agrement: stage type 'eval' does not report 'agrement'; " \
           "did you mean 'agreement'? it reports: agreement, agreement_free," in err
    edit(project / "p.yaml", "agrement: {min", "agreement: {min")
    err = check(capsys, project / "p.yaml", "--set", "stages.baseline.gate.perplexty.max=10")
    assert "--set: stages[0].gate.perplexty: stage type 'baseline' does not report 'perplexty'; did you mean " \
           "'perplexity'?" in err


def test_a_stage_type_without_metrics_is_not_checked(project: Path, capsys: pytest.CaptureFixture) -> None:
    path = project / "p.yaml"
    edit(path, "uses: eval", "uses: tests.fixtures.stages.measure")
    edit(path, "agreement: {min", "anything_at_all: {min")
    assert main(["check", str(path)]) == 0, capsys.readouterr().err


# -- a stage type's own checks ------------------------------------------------------------------
def test_a_plan_format_this_device_cannot_run_fails_before_anything_runs(project: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    path = project / "p.yaml"
    edit(path, "  - id: check\n", "  - id: plan\n    uses: plan\n    needs: baseline\n    with:\n"
                                  "      force:\n        '*.mlp.*': fp8\n  - id: check\n")
    err = check(capsys, path)
    assert f"{path}:15: stages[1].with.force.*.mlp.*: format 'fp8' needs a CUDA device" in err
    assert not (project / "runs").exists()
    err = check(capsys, path, "--set", "stages.plan.with.force={'*.mlp.*': w9a9}")
    assert "stages[1].with.force.*.mlp.*: unknown format 'w9a9'" in err


# -- device ------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cuda:0,1", "gpu", "CUDA"])
def test_unknown_devices(project: Path, capsys: pytest.CaptureFixture, device: str) -> None:
    err = check(capsys, project / "p.yaml", "--set", f"model.device={device}")
    assert err.endswith(f"--set: model.device: unknown device '{device}'; use cpu, cuda or cuda:N (one device)")


def test_a_device_this_machine_lacks(project: Path, capsys: pytest.CaptureFixture) -> None:
    path = edit(project / "p.yaml", "device: cpu", "device: cuda:7")
    err = check(capsys, path)
    assert err.startswith(f"error: {path}:4: model.device: device 'cuda:7': ")
    if torch.cuda.is_available():
        assert "CUDA device(s)" in err
    else:
        assert "CUDA is not available here" in err


# -- model files -------------------------------------------------------------------------------
def test_unsupported_model_type_lists_the_families(project: Path, capsys: pytest.CaptureFixture) -> None:
    edit(project / "model" / "config.json", '"model_type": "llama"', '"model_type": "gpt2"')
    err = check(capsys, project / "p.yaml")
    assert err.endswith(f"p.yaml:3: model.hf: {project}/model/config.json: unsupported model_type 'gpt2'; "
                        "supported: gemma3_text, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe")


def test_config_json_missing_broken_or_implausible(project: Path, capsys: pytest.CaptureFixture) -> None:
    config = project / "model" / "config.json"
    text = config.read_text()
    config.write_text(text[: len(text) // 2])
    assert "config.json: not valid JSON" in check(capsys, project / "p.yaml")
    config.write_text(json.dumps({**json.loads(text), "num_attention_heads": 0}))
    assert "config.json: implausible config" in check(capsys, project / "p.yaml")
    config.write_text(json.dumps({k: v for k, v in json.loads(text).items() if k != "hidden_size"}))
    assert "config.json: no 'hidden_size'" in check(capsys, project / "p.yaml")
    config.unlink()
    assert "p.yaml:3: model.hf: " in (err := check(capsys, project / "p.yaml"))
    assert err.endswith("config.json is missing: not a Hugging Face model directory")


def test_a_hub_id_reads_the_local_cache(project: Path, capsys: pytest.CaptureFixture,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from opus.pipeline.spec import load_pipeline

    cache = project / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    edit(project / "p.yaml", "hf: model", "hf: tiny-org/tiny-llama")
    err = check(capsys, project / "p.yaml")
    assert err == (f"error: {project}/p.yaml:3: model.hf: 'tiny-org/tiny-llama' is not a directory "
                   f"({project}/tiny-org/tiny-llama) and not in the Hugging Face cache {cache} (no "
                   "models--tiny-org--tiny-llama/snapshots there); Opus never downloads: download it there first "
                   "(hf download tiny-org/tiny-llama) or set HF_HUB_CACHE / HF_HOME to the cache that holds it")
    repo = cache / "models--tiny-org--tiny-llama"
    shutil.copytree(project / "model", repo / "snapshots" / "c0ffee")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee")
    assert main(["check", str(project / "p.yaml")]) == 0, capsys.readouterr().err
    loaded = load_pipeline(project / "p.yaml")
    assert loaded.spec.model.hf == "tiny-org/tiny-llama"  # as written; every reader gets the snapshot
    assert loaded.spec.model.source() == {"hf": str(repo / "snapshots" / "c0ffee")}


def test_a_factory_returning_a_transformers_model_opus_cannot_load(project: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    (project / "hf_models.py").write_text(
        "import transformers as tf\n"
        "def gpt2():\n"
        "    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=50, n_embd=8, n_layer=1, n_head=2,\n"
        "                                            bos_token_id=0, eos_token_id=0))\n"
        "def llama():\n"
        "    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=50, hidden_size=8, intermediate_size=16,\n"
        "                                              num_hidden_layers=1, num_attention_heads=2))\n")
    edit(project / "p.yaml", "hf: model", "factory: hf_models:gpt2")
    err = check(capsys, project / "p.yaml")
    assert err.startswith(f"error: {project}/p.yaml:3: model.factory: factory 'hf_models:gpt2' returned "
                          "GPT2LMHeadModel (model_type 'gpt2'), a transformers model of a family Opus cannot load")
    edit(project / "p.yaml", "hf_models:gpt2", "hf_models:llama")
    assert main(["check", str(project / "p.yaml")]) == 0, capsys.readouterr().err
    edit(project / "p.yaml", "hf_models:llama", "hf_models:nothing")
    assert "model.factory: factory 'hf_models:nothing': module 'hf_models' has no callable" in check(
        capsys, project / "p.yaml")


def test_contexts_beyond_a_sliding_window(project: Path, capsys: pytest.CaptureFixture) -> None:
    config = project / "model" / "config.json"
    raw = json.loads(config.read_text())
    config.write_text(json.dumps({**raw, "model_type": "mistral", "architectures": ["MistralForCausalLM"],
                                  "sliding_window": 600}))
    err = check(capsys, project / "p.yaml")  # the default workload: 512 + 128 tokens
    assert err.endswith("workload.input_len: input_len + output_len (512 + 128) = 640 tokens, beyond the model's "
                        "sliding window of 600: Opus does not implement sliding-window attention and runs only "
                        "contexts within it")
    edit(project / "p.yaml", "stages:", "workload: {input_len: 16, output_len: 4}\nstages:")
    config.write_text(json.dumps({**raw, "model_type": "mistral", "sliding_window": 24}))
    assert "p.yaml:6: data.evaluation.seq_len: seq_len = 32 tokens, beyond the model's sliding window of 24" in (
        check(capsys, project / "p.yaml"))
    config.write_text(json.dumps({**raw, "model_type": "mistral", "sliding_window": 32}))
    assert main(["check", str(project / "p.yaml")]) == 0, capsys.readouterr().err


def test_truncated_safetensors(project: Path, capsys: pytest.CaptureFixture) -> None:
    weights = project / "model" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    err = check(capsys, project / "p.yaml")
    assert f"p.yaml:3: model.hf: {weights} ({len(data) - 100} bytes): not a complete safetensors file" in err
    weights.write_bytes(data[:6])
    assert "not a complete safetensors file" in check(capsys, project / "p.yaml")


def test_weights_that_are_not_a_regular_file(project: Path, capsys: pytest.CaptureFixture) -> None:
    """A FIFO named model.safetensors would block the first read until killed: refused before it is opened."""
    import os

    weights = project / "model" / "model.safetensors"
    weights.unlink()
    os.mkfifo(weights)
    err = check(capsys, project / "p.yaml")
    assert err.endswith(f"p.yaml:3: model.hf: not a regular file: a FIFO (named pipe): {weights}")


def test_a_gate_bound_must_be_finite(project: Path, capsys: pytest.CaptureFixture) -> None:
    """A bound of .nan compares false with everything: such a gate could never fail."""
    for written, read in ((".nan", "nan"), ("-.inf", "-inf")):
        path = edit(project / "p.yaml", "min: 0.9", f"min: {written}")
        err = check(capsys, path)
        assert err.endswith(f"p.yaml:14: stages[1].gate.agreement.min: Input should be a finite number (got {read})")
        edit(path, f"min: {written}", "min: 0.9")


def test_weights_beyond_the_machine_memory(project: Path, capsys: pytest.CaptureFixture,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=10_000, available=10_000))
    err = check(capsys, project / "p.yaml")
    assert "p.yaml:3: model.hf: the weights need" in err and "more than this machine's 0.0 GB" in err


def test_gguf_headers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import gguf
    import numpy as np

    from tests.models.opus_model_kit import make_hf, write_gguf

    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.replace("hf: model", "gguf: m.gguf").replace(
        '  evaluation: {files: ["data/*.txt"], samples: 4, seq_len: 32}\n', "  {}\n"))
    data = write_gguf(make_hf("llama"), "llama", tmp_path / "m.gguf").read_bytes()
    assert main(["check", str(path)]) == 0, capsys.readouterr().err
    (tmp_path / "m.gguf").write_bytes(data[: len(data) - 1000])
    assert "p.yaml:3: model.gguf: " in (err := check(capsys, path)) and "not a complete GGUF file" in err
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert check(capsys, path).endswith("unsupported GGUF architecture 'gpt2'; supported: llama, qwen2, qwen2moe, "
                                        "qwen3, qwen3moe")


# -- text --------------------------------------------------------------------------------------
def test_binary_and_empty_evaluation_files(project: Path, capsys: pytest.CaptureFixture) -> None:
    path = edit(project / "p.yaml", "data/*.txt", "held.txt")
    (project / "held.txt").write_bytes(b"w1 w2 \x00\x01\x02")
    err = check(capsys, path)
    assert err.endswith(f"p.yaml:6: data.evaluation.files: cannot read {project}/held.txt: a binary file, not "
                        "text (NUL byte at offset 6)")
    (project / "held.txt").write_bytes("w1 caf\xe9".encode("latin-1"))
    assert "held.txt: not UTF-8 text (byte 0xe9 at offset 6)" in check(capsys, path)
    (project / "held.txt").write_text("")
    assert check(capsys, path).endswith(f"p.yaml:6: data.evaluation.files: {project}/held.txt: no text (empty)")


def test_datasets_of_data_files_and_from_the_hub_cache(project: Path, capsys: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setenv("HF_HUB_CACHE", str(project / "hub"))
    texts = [(project / "data" / f"part{i}.txt").read_text() for i in range(2)]
    (project / "parquet").mkdir()
    datasets.Dataset.from_dict({"body": texts}).to_parquet(str(project / "parquet" / "train.parquet"))
    capsys.readouterr()  # datasets' own progress bar
    path = edit(project / "p.yaml", 'files: ["data/*.txt"]', "dataset: parquet, text_column: body")
    assert main(["check", str(path)]) == 0, capsys.readouterr().err
    edit(path, "dataset: parquet, text_column: body", "dataset: some-org/absent")
    err = check(capsys, path)
    assert err.startswith(f"error: {path}:6: data.evaluation.dataset: 'some-org/absent' is not a directory "
                          f"({project}/some-org/absent) and not in the Hugging Face cache {project}/hub")
    assert err.endswith("(hf download some-org/absent --repo-type dataset) or set HF_HUB_CACHE / HF_HOME to the "
                        "cache that holds it")
    edit(path, "dataset: some-org/absent", "dataset: ./absent")
    assert check(capsys, path).endswith(f"data.evaluation.dataset: dataset {project}/absent does not exist")


def test_too_little_text_for_the_samples(project: Path, capsys: pytest.CaptureFixture) -> None:
    err = check(capsys, project / "p.yaml", "--set", "data.evaluation.samples=20")
    assert err.startswith("error: --set: data.evaluation.samples: ")
    assert err.endswith("301 tokens make 9 blocks of 32, but 20 samples were asked for; add text or lower "
                        "samples/seq_len")


def test_a_model_without_tokenizer_cannot_read_text(project: Path, capsys: pytest.CaptureFixture) -> None:
    (project / "model" / "tokenizer.json").unlink()
    err = check(capsys, project / "p.yaml")
    assert "p.yaml:6: data.evaluation: the model has no tokenizer" in err


def test_datasets_need_one_split_and_the_text_column(project: Path, capsys: pytest.CaptureFixture) -> None:
    import datasets

    ds = datasets.Dataset.from_dict({"body": [(project / "data" / "part0.txt").read_text()] * 2})
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(project / "dd"))
    capsys.readouterr()  # the save's progress bars
    path = edit(project / "p.yaml", '{files: ["data/*.txt"], samples: 4, seq_len: 32}',
                "\n    dataset: dd\n    text_column: text\n    samples: 4\n    seq_len: 32")
    err = check(capsys, path)
    assert err.endswith(f"p.yaml:7: data.evaluation.dataset: dataset {project}/dd holds splits train, test; "
                        "name one with split: train (or point dataset at dd/train)")
    edit(path, "dataset: dd\n", "dataset: dd\n    split: train\n")
    err = check(capsys, path)
    assert f"p.yaml:9: data.evaluation.text_column: dataset {project}/dd has no column 'text' (columns: body)" in err
    edit(path, "text_column: text", "text_column: body")
    assert main(["check", str(path)]) == 0, capsys.readouterr().err
    edit(path, "split: train", "split: validation")
    assert "p.yaml:8: data.evaluation.split: dataset" in check(capsys, path)


# -- opus run and resume -----------------------------------------------------------------------
def test_run_refuses_before_writing_anything(project: Path, capsys: pytest.CaptureFixture) -> None:
    edit(project / "p.yaml", "ppl: {max", "perplexty: {max")
    err = check(capsys, project / "p.yaml", "--runs-dir", str(project / "runs"), "--quiet", command="run")
    assert "stages[1].gate.perplexty: stage type 'eval' does not report 'perplexty'" in err
    assert not (project / "runs").exists()


@pytest.mark.parametrize(("content", "says"), [
    ('{"run_id": "r", "base_dir": "/tm', "damaged run file, cannot resume: Unterminated string"),
    ("[1, 2]", "damaged run file, cannot resume: a JSON object expected, got list"),
    ("", "damaged run file, cannot resume: Expecting value"),
    ('{"run_id": "r", "starts": []}', "damaged run file, cannot resume: no valid 'base_dir'"),
    (b"\xff\xfe{}", "damaged run file, cannot resume: "),
])
def test_resume_with_a_damaged_run_json(project: Path, capsys: pytest.CaptureFixture, content: str | bytes,
                                        says: str) -> None:
    run_dir = project / "runs" / "r"
    run_dir.mkdir(parents=True)
    shutil.copy(project / "p.yaml", run_dir / "pipeline.yaml")
    run_file = run_dir / "run.json"
    run_file.write_bytes(content if isinstance(content, bytes) else content.encode())
    err = check(capsys, run_dir, "--quiet", command="resume")
    assert err.startswith(f"error: {run_file}: {says}")
    if "no valid" in says:  # a JSON object: status needs none of resume's fields
        return
    # A torn run.json is no finished run: `opus status` says the same as resume, and exits 2.
    err = check(capsys, run_dir, command="status")
    status_says = says.replace("cannot resume", "cannot tell the run's status")
    assert err.startswith(f"error: {run_file}: {status_says}")


@pytest.mark.parametrize("name", ["k3.yaml", "smoke.yaml"])
def test_the_shipped_pipelines_pass(repo_root: Path, capsys: pytest.CaptureFixture, name: str) -> None:
    assert main(["check", str(repo_root / "pipelines" / name)]) == 0, capsys.readouterr().err
