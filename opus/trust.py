"""What a file on disk may make Opus import or call: the rule behind loading runs, checkpoints and exports.

A run, a checkpoint or an export is data that people download and share, as they do Hugging Face
repositories. Loading one (``opus.load``, ``opus serve``, ``load_exported``) runs under
``loading(path, trust_code)``: while it lasts, a module named in the files (a KV cache's
``provider``, an old module path) is imported only when it is Opus's own or already imported
(importing it runs nothing new), and a model ``factory`` named there is never called. With
``trust_code=True`` (``--trust-code``), as transformers' ``trust_remote_code``, the caller vouches
for that code: it is imported from the installed packages, never from the loaded directory itself.

A pipeline file is the user's own: its ``uses:`` and ``factory:`` run as written, outside any
``loading`` (``opus run``, ``opus resume``, the stages' workers).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from opus.errors import InputError

HINT = "pass trust_code=True (opus serve --trust-code) only if you trust whoever made it"


@dataclass(frozen=True)
class Loading:
    """What is being loaded (a run, checkpoint or export directory) and whether its code is trusted."""

    root: Path
    trust_code: bool


_LOADING: ContextVar[Loading | None] = ContextVar("opus_loading", default=None)


class UntrustedCode(InputError):
    """A file being loaded names code that loading it would run."""


@contextmanager
def loading(root: Path | str, trust_code: bool = False) -> Iterator[Loading]:
    """Everything imported or called by name inside this block comes from files under ``root``."""
    state = Loading(Path(root).resolve(), trust_code)
    token = _LOADING.set(state)
    try:
        yield state
    finally:
        _LOADING.reset(token)


def current() -> Loading | None:
    """The load in progress in this context, or None: the user's own pipeline is running."""
    return _LOADING.get()


def is_opus_own(module_name: str) -> bool:
    return module_name == "opus" or module_name.startswith("opus.")


def check_import(module_name: str, what: str) -> None:
    """Raise ``UntrustedCode`` unless importing ``module_name`` (named in a file as ``what``) is allowed now."""
    state = current()
    if state is None or is_opus_own(module_name) or module_name in sys.modules:
        return
    if not state.trust_code:
        raise UntrustedCode(f"{what} names the module {module_name!r}, which is not Opus's own: importing it "
                            f"would run its code; {HINT}", file=str(state.root))
    _outside(module_name, what, state)


def check_call(reference: str, what: str) -> None:
    """Raise ``UntrustedCode`` unless calling ``reference`` (``module:function``, named as ``what``) is allowed
    now: never while loading without trust (any imported function, ``os:system`` included, could be named)."""
    state = current()
    if state is None:
        return
    if not state.trust_code:
        raise UntrustedCode(f"{what} is the function {reference!r}: loading it would run that code; {HINT}",
                            file=str(state.root))
    _outside(reference.partition(":")[0], what, state)


def _outside(module_name: str, what: str, state: Loading) -> None:
    """A trusted name still never imports from the loaded directory: where would its top package come from?"""
    top = module_name.split(".")[0]
    if top in sys.modules:
        return
    # A top-level name is found without executing anything, through every finder (an editable install's too).
    spec = importlib.util.find_spec(top)
    if spec is None:
        raise UntrustedCode(f"{what}: no installed module {top!r} (a loaded directory is never put on the import "
                            "path)", file=str(state.root))
    places = [spec.origin, *(spec.submodule_search_locations or [])]
    for place in places:
        if place and Path(place).resolve().is_relative_to(state.root):
            raise UntrustedCode(f"{what}: the module {top!r} would come from the loaded directory itself "
                                f"({place}); Opus imports only installed code", file=str(state.root))
