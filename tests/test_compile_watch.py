"""A stage says when torch compiles: dynamo's compile start and end reach the stage's progress, marked,
with the last phase and count, so that the runner can show it and hold its ETA."""

from __future__ import annotations

import torch

from opus import compile_watch
from opus.pipeline.context import StageContext


def test_a_compile_reaches_the_stage_as_marked_progress(tmp_path) -> None:  # noqa: ANN001
    messages: list[dict] = []
    ctx = StageContext(run_dir=tmp_path, stage_id="s", uses="u", spec=None, base_dir=tmp_path, upstream={},
                       incoming=None, out_dir=tmp_path / "out", report=messages.append)
    ctx.progress(3, 10, "P")
    compile_watch.report_to(ctx.compiling)
    try:
        compile_watch.watch()
        compile_watch.watch()  # once per process: no second pair of messages

        def fn(x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x) * 2 + 1

        compiled = torch.compile(fn, backend="eager")  # dynamo traces; no C++ build needed here
        compiled(torch.ones(4))
        marked = [m for m in messages if "compiling" in m]
        assert [m["compiling"] for m in marked] == [True, False]
        assert all((m["done"], m["total"], m["what"]) == (3, 10, "P") for m in marked)
        messages.clear()
        compiled(torch.ones(4))  # cached: nothing compiles, nothing is said
        assert messages == []
    finally:
        compile_watch.report_to(None)
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(3))  # no sink: nothing to tell, no error
    assert messages == []
