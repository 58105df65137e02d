"""Tell whoever watches a stage when torch is compiling.

A compile of a new shape (a decode step at a new batch size, a prefill bucket) can take minutes on a
30-layer model, and no unit of work advances meanwhile: the progress line sat still and its ETA grew
with nothing to say why. Dynamo announces the start and the end of each compile (its callback
handler, outermost compile only); ``watch`` forwards them to the sink the stage worker set with
``report_to``. ``watch`` is called where Opus calls ``torch.compile``, not at start-up: importing
dynamo costs a second, which a stage that compiles nothing should not pay.
"""

from __future__ import annotations

from collections.abc import Callable

_sink: Callable[[bool], None] | None = None
_watching = False


def report_to(sink: Callable[[bool], None] | None) -> None:
    """``sink(True)`` when a compile starts, ``sink(False)`` when it ends; None: tell no one."""
    global _sink
    _sink = sink


def _tell(compiling: bool) -> None:
    if _sink is not None:
        _sink(compiling)


def watch() -> None:
    """Forward dynamo's compile start and end to the sink (registered once per process)."""
    global _watching
    if _watching:
        return
    from torch._dynamo.callback import callback_handler

    callback_handler.register_start_callback(lambda _args: _tell(True))
    callback_handler.register_end_callback(lambda _args: _tell(False))
    _watching = True
