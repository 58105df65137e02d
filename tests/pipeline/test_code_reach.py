"""Stage keys hash the code that can change a stage's result, and only that."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from opus.pipeline import code_reach
from opus.pipeline.code_reach import NEVER_REACHED, reach, stage_reach
from opus.pipeline.registry import known_stage_types, load_stage_type


@pytest.mark.parametrize("name", sorted(known_stage_types()))
def test_no_stage_reaches_report_cli_or_bench(name: str) -> None:
    module = load_stage_type(name).module.__name__
    reached = stage_reach(module)
    assert module in reached and "opus.pipeline.worker" in reached and "opus.recipe" in reached
    assert not [m for m in reached if m.startswith(NEVER_REACHED)]


def test_reach_follows_imports_inside_functions_and_the_kernels_a_stage_uses() -> None:
    reached = stage_reach("stages.quantize")
    assert {"opus.quant.kernels", "opus.quant.modules", "opus.kv.static", "stages"} <= set(reached)
    eval_reach = stage_reach("stages.eval")  # measure_incoming imports the engine inside a function
    assert "opus.runtime.engine" in eval_reach and "opus.runtime.metrics" in eval_reach


def _package(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_an_edit_changes_the_digest_only_of_stages_that_reach_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _package(tmp_path, {
        "reachpkg/__init__.py": "",
        "reachpkg/kernel.py": "def k():\n    return 1\n",
        "reachpkg/plots.py": "def p():\n    return 2\n",
        "reachpkg/uses_kernel.py": "def run():\n    from reachpkg.kernel import k\n    return k()\n",
        "reachpkg/uses_plots.py": "from . import plots\n",
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(code_reach, "WORKER_ROOTS", ())

    def digests() -> tuple[str, str]:
        for fn in (code_reach._origin, code_reach.imports_of):
            fn.cache_clear()
        return (code_reach.stage_code_digest("reachpkg.uses_kernel"),
                code_reach.stage_code_digest("reachpkg.uses_plots"))

    assert reach(("reachpkg.uses_plots",), ("reachpkg",)) == ["reachpkg", "reachpkg.plots", "reachpkg.uses_plots"]
    before = digests()
    (tmp_path / "reachpkg/plots.py").write_text("def p():\n    return 3  # fixed a typo\n")
    after_plots = digests()
    assert after_plots[0] == before[0] and after_plots[1] != before[1]
    (tmp_path / "reachpkg/kernel.py").write_text("def k():\n    return 4\n")
    after_kernel = digests()
    assert after_kernel[0] != after_plots[0] and after_kernel[1] == after_plots[1]
    sys.modules.pop("reachpkg", None)
    shutil.rmtree(tmp_path / "reachpkg")
