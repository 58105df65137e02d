"""docs/extending.md's worked example is code that runs: its stage module loads as a stage type by dotted
path and its own in-process test passes."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from opus.pipeline.preflight import undeclared_metrics
from opus.pipeline.registry import load_stage_type
from tests.conftest import REPO

GUIDE = (REPO / "docs" / "extending.md").read_text(encoding="utf-8")


def _block(starts: str) -> str:
    for match in re.finditer(r"^```python\n(.*?)^```", GUIDE, re.S | re.M):
        if match.group(1).startswith(starts):
            return match.group(1)
    raise AssertionError(f"docs/extending.md has no python block starting {starts!r}")


def test_the_guides_stage_is_a_stage_type_and_does_what_it_says(tmp_path: Path, monkeypatch) -> None:
    package = tmp_path / "mypkg_extending_guide"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "weights.py").write_text(_block('"""``weights``'))
    monkeypatch.syspath_prepend(str(tmp_path))
    stage_type = load_stage_type("mypkg_extending_guide.weights")  # by dotted path, as the guide says
    weights = stage_type.module
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2).to(torch.bfloat16))
    with torch.no_grad():
        model[0].weight.zero_()
    ctx = SimpleNamespace(load_model=lambda: SimpleNamespace(model=model), progress=lambda *a: None,
                          log=lambda message: None)
    result = weights.run(ctx, weights.Config())
    assert result.metrics["weight_elements"] == 30 and result.metrics["elements_bfloat16"] == 10
    assert result.metrics["zero_fraction"] == pytest.approx(16 / 30)
    assert result.model is None and not undeclared_metrics(weights, result.metrics)
    assert stage_type.role(weights.Config()) == "measure"


def test_the_guides_test_is_the_one_it_shows() -> None:
    """The guide's test module names the checks the test above runs."""
    shown = _block('"""The ``weights`` stage')
    assert "elements_bfloat16\"] == 10" in shown and "zero_fraction\"] == pytest.approx(16 / 30)" in shown
