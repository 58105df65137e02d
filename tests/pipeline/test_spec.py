"""Validation before anything runs: each failure is one line naming file, line and key; exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from opus.errors import InputError
from opus.pipeline.graph import validate
from opus.pipeline.spec import load_pipeline
from tests.helpers import MEASURE, SCALE, pipeline, run_cli, write_pipeline

GOOD = """\
name: t
model:
  factory: tests.fixtures.tiny:tiny_model
stages:
  - id: base
    uses: tests.fixtures.stages.measure
    with: {baseline: true}
  - id: scale
    uses: tests.fixtures.stages.scale
    needs: [base]
    with:
      factor: 2.0
    gate:
      quality: {min: 0.5}
"""


def _error(tmp_path: Path, text: str, overrides: list[str] | None = None) -> str:
    path = write_pipeline(tmp_path / "p.yaml", text)
    with pytest.raises(InputError) as info:
        validate(load_pipeline(path, overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_good_pipeline_validates(tmp_path: Path) -> None:
    loaded = load_pipeline(write_pipeline(tmp_path / "p.yaml", GOOD))
    graph, types = validate(loaded)
    assert list(graph.edges) == [("base", "scale")]
    assert types["scale"][1].factor == 2.0
    assert loaded.spec.workload.batch_size == 32 and loaded.spec.workload.input_len == 512


def test_yaml_syntax_error_names_line(tmp_path: Path) -> None:
    message = _error(tmp_path, GOOD.replace("factor: 2.0", "factor: [2.0"))
    assert "p.yaml:1" in message and "YAML syntax error" in message


def test_a_directory_is_not_a_pipeline_file_a_run_directory_names_its_commands(tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture) -> None:
    assert run_cli("check", tmp_path) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path}: a directory, not a pipeline file"
    (tmp_path / "run.json").write_text("{}")
    assert run_cli("check", tmp_path) == 2
    assert "a run directory: `opus resume` continues it, `opus verify` checks its files" in capsys.readouterr().err
    assert run_cli("check", tmp_path / "nope.yaml") == 2
    assert capsys.readouterr().err.strip().endswith("nope.yaml: file not found")


def test_misspelt_key_names_line_and_key(tmp_path: Path) -> None:
    message = _error(tmp_path, GOOD.replace("  - id: scale\n", "  - id: scale\n    neds: [base]\n"))
    assert message.endswith("p.yaml:9: stages[1].neds: unknown key 'neds'")


def test_misspelt_stage_config_key(tmp_path: Path) -> None:
    message = _error(tmp_path, GOOD.replace("factor: 2.0", "facter: 2.0"))
    assert "p.yaml:12: stages[1].with.facter: unknown key 'facter' for stage type" in message


def test_wrong_type_and_range(tmp_path: Path) -> None:
    message = _error(tmp_path, GOOD.replace("stages:", "workload: {batch_size: 0}\nstages:"))
    assert "p.yaml:4: workload.batch_size" in message and "greater than 0" in message
    message = _error(tmp_path, GOOD.replace("factor: 2.0", "factor: lots"))
    assert "stages[1].with.factor" in message and "'lots'" in message


def test_duplicate_yaml_key(tmp_path: Path) -> None:
    message = _error(tmp_path, GOOD.replace("name: t\n", "name: t\nname: u\n"))
    assert "p.yaml:2" in message and "duplicate key 'name'" in message


def test_unknown_stage_type_lists_known(tmp_path: Path) -> None:
    message = _error(tmp_path, GOOD.replace("uses: tests.fixtures.stages.scale", "uses: quantise"))
    assert "p.yaml:9: stages[1].uses: unknown stage type 'quantise' (known:" in message


def test_duplicate_ids(tmp_path: Path) -> None:
    message = _error(tmp_path, GOOD.replace("id: scale", "id: base"))
    assert "stages[1].id: duplicate stage id 'base'" in message


def test_needs_unknown_stage(tmp_path: Path) -> None:
    message = _error(tmp_path, GOOD.replace("needs: [base]", "needs: [bsae]"))
    assert "p.yaml:10: stages[1].needs[0]: needs 'bsae', which names no stage" in message


def test_cycle_is_named(tmp_path: Path) -> None:
    spec = pipeline([{"id": "a", "uses": MEASURE, "needs": ["c"]}, {"id": "b", "uses": MEASURE, "needs": ["a"]},
                     {"id": "c", "uses": SCALE, "needs": ["b"]}])
    import yaml

    message = _error(tmp_path, yaml.safe_dump(spec, sort_keys=False))
    assert "cycle" in message and "a -> b -> c -> a" in message


def test_missing_model_path(tmp_path: Path) -> None:
    text = GOOD.replace("  factory: tests.fixtures.tiny:tiny_model", "  hf: no/such/dir")
    message = _error(tmp_path, text)
    assert "p.yaml:3: model.hf: model path does not exist" in message


def test_missing_data_file(tmp_path: Path) -> None:
    text = GOOD.replace("stages:", "data:\n  evaluation: {files: [held/*.txt]}\nstages:")
    message = _error(tmp_path, text)
    assert "data.evaluation.files[0]: no file matches 'held/*.txt'" in message


def test_gate_needs_a_bound(tmp_path: Path) -> None:
    message = _error(tmp_path, GOOD.replace("quality: {min: 0.5}", "quality: {}"))
    assert "stages[1].gate.quality" in message


def test_set_overrides_by_stage_id(tmp_path: Path) -> None:
    path = write_pipeline(tmp_path / "p.yaml", GOOD)
    loaded = load_pipeline(path, ["stages.scale.with.factor=3.5", "workload.batch_size=4"])
    assert loaded.spec.stages[1].with_["factor"] == 3.5
    assert loaded.spec.workload.batch_size == 4
    message = _error(tmp_path, GOOD, ["stages.scale.with.factor=-x"])
    assert message.startswith("--set: stages[1].with.factor")
    message = _error(tmp_path, GOOD, ["stages.nope.with.factor=1"])
    assert "no stage with id 'nope'" in message


def test_cli_exit_code_2_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write_pipeline(tmp_path / "p.yaml", GOOD.replace("factor: 2.0", "facter: 2.0"))
    assert run_cli("run", path, "--runs-dir", tmp_path / "runs") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "facter" in err
    assert not (tmp_path / "runs").exists()


# -- the pipeline file itself: limits that keep a hostile or broken file to one line ---------------
def _check_error(capsys: pytest.CaptureFixture, *args: object) -> str:
    assert run_cli("check", *args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err.strip()


def test_non_utf8_pipeline_names_line_and_offset(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(GOOD.replace("name: t", "name: t\ndescription: caf\xe9").encode("latin-1"))
    err = _check_error(capsys, path)
    assert err.endswith(f"p.yaml:2: not UTF-8 text: byte 0xe9 at offset {len('name: t') + 17} (save the file as UTF-8)")


def test_control_bytes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """YAML's reader refuses them while the loader is built, before any parse error could name a line."""
    path = tmp_path / "p.yaml"
    path.write_bytes(b"\x00\x01 not yaml at all")
    assert _check_error(capsys, path).endswith("p.yaml:1: not a YAML text: unacceptable character #x0000: "
                                               "special characters are not allowed")
    path.write_bytes(GOOD.replace("name: t", "name: t\ndescription: a\x07bell").encode())
    assert "p.yaml:2: not a YAML text: unacceptable character #x0007" in _check_error(capsys, path)


def test_pipeline_larger_than_the_limit(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from opus.pipeline.yaml_lines import MAX_BYTES

    path = write_pipeline(tmp_path / "p.yaml", GOOD + "#" * MAX_BYTES + "\n")
    err = _check_error(capsys, path)
    assert err.endswith(f"p.yaml: {path.stat().st_size} bytes is too large for a pipeline file (at most {MAX_BYTES})")


def test_deep_nesting_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write_pipeline(tmp_path / "p.yaml", GOOD.replace("factor: 2.0", "factor: " + "[" * 3000 + "]" * 3000))
    assert _check_error(capsys, path).endswith("p.yaml:12: nested more than 64 levels deep")
    path = write_pipeline(tmp_path / "p.yaml", GOOD)
    err = _check_error(capsys, path, "--set", "stages.scale.with.factor=" + "{a: " * 3000)
    assert err.endswith("--set: stages.scale.with.factor: nested more than 64 levels deep")


def test_alias_expansion_is_limited(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A 'billion laughs' document: 9 levels of 9 aliases would expand to 9**9 nodes."""
    laughs = "l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
        f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10))
    path = write_pipeline(tmp_path / "p.yaml", laughs + GOOD)
    assert "p.yaml:1: the document expands to" in _check_error(capsys, path)
    path = write_pipeline(tmp_path / "p.yaml", "a: &a [*a]\n" + GOOD)
    assert "an alias refers to a node that contains it" in _check_error(capsys, path)


def test_a_list_as_a_key_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write_pipeline(tmp_path / "p.yaml", GOOD.replace("factor: 2.0", "? [factor]\n      : 2.0"))
    assert "p.yaml:12: YAML syntax error: a key must be a plain value, not a sequence" in _check_error(capsys, path)


def test_ordinary_aliases_still_work_and_name_lines(tmp_path: Path) -> None:
    text = GOOD.replace("    with: {baseline: true}", "    with: {baseline: true}\n    gate: &g {quality: {min: 0.5}}")
    text = text.replace("    gate:\n      quality: {min: 0.5}", "    gate: *g")
    loaded = load_pipeline(write_pipeline(tmp_path / "p.yaml", text))
    assert loaded.spec.stages[0].gate == loaded.spec.stages[1].gate
    # A key under an alias has no line of its own: the error points at the key holding the alias.
    message = _error(tmp_path, text.replace("    with:\n      factor: 2.0", "    with: *g"))
    assert "p.yaml:12: stages[1].with.quality: " in message


def test_run_threads_is_a_count_or_auto(tmp_path: Path) -> None:
    auto = load_pipeline(write_pipeline(tmp_path / "p.yaml", GOOD.replace("stages:", "run: {threads: auto}\nstages:")))
    assert auto.spec.run.threads == "auto"
    for wrong in ("0", "many"):
        message = _error(tmp_path, GOOD.replace("stages:", f"run: {{threads: {wrong}}}\nstages:"))
        assert "run.threads" in message, message
