"""docs/stages.md is generated from the stages' pydantic configs and stays so; `opus stages NAME` prints one."""

from __future__ import annotations

from pathlib import Path

import pytest

from opus.cli.main import main
from opus.cli.stage_docs import option_rows, reference_markdown
from opus.pipeline.registry import known_stage_types, load_stage_type

DOCS = Path(__file__).resolve().parents[2] / "docs" / "stages.md"


def test_docs_stages_md_regenerates_byte_identical() -> None:
    assert DOCS.read_text(encoding="utf-8") == reference_markdown(), \
        "docs/stages.md is stale: regenerate it with `opus stages --markdown > docs/stages.md`"


def test_every_option_of_every_stage_is_there_nested_ones_dotted() -> None:
    text = reference_markdown()
    for name in known_stage_types():
        config = load_stage_type(name).config_class
        assert f"## `{name}`" in text
        for field_name, field in config.model_fields.items():
            assert f"| `{field.alias or field_name}` |" in text, (name, field_name)
    keys = [row[0] for row in option_rows(load_stage_type("plan").config_class)]
    assert "sensitivity.method" in keys and "budget.max_ppl_increase" in keys
    eval_rows = {row[0]: row for row in option_rows(load_stage_type("eval").config_class)}
    assert eval_rows["long_generation_tokens"][1:3] == ("int", "0")


def test_opus_stages_name_prints_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stages", "export"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## `export`") and "| `compare_blocks` | `int` | `8` |" in out
    assert main(["stages", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown stage type 'nope' (known: baseline" in err
