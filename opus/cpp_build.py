"""Opus's C++ ops, built once per machine and torch version with torch's cpp_extension.

g++ and ninja (as inductor's C++ backend needs) build a source (which includes the torch headers it needs,
not all of torch's C++ API) into a shared library cached under ``~/.cache/torch_extensions`` and load it
into the process; its ``TORCH_LIBRARY`` blocks register the ops.
A first build takes 10-30 s, so a line on stderr says what is built before and how long it took after;
a cached build loads silently. One process builds at a time (``build_guard``), and a build killed mid-way
does not hang the next one. ``OPUS_NATIVE_OPS=0`` builds nothing. Whoever calls ``build`` keeps a
Python path for when it returns a reason (no compiler, a failed build).
"""

from __future__ import annotations

import fcntl
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from opus.atomic import write_text


def build(name: str, source: str, what: str, cflags: tuple[str, ...] = ("-O2", "-Wno-psabi"),
          ldflags: tuple[str, ...] = ()) -> str | None:
    """Build (once per machine and torch) and load ``source`` as ``name``; None when loaded, else why not.
    ``what`` names it in the lines on stderr and in the reason."""
    if os.environ.get("OPUS_NATIVE_OPS", "1") == "0":
        return "OPUS_NATIVE_OPS=0"
    from torch.utils import cpp_extension

    name = library_name(name)
    started = time.monotonic()
    try:
        directory = Path(cpp_extension._get_build_directory(name, verbose=False))
        path = directory / f"{name}.cpp"  # its own file: load_inline would prepend torch/extension.h (+25 s)
        changed = not path.exists() or path.read_text() != source
        building = changed or not is_built(name)
        if building:  # 10-30 s of silence otherwise, once per machine
            print(f"opus: building {what} (once per machine and torch version, 10-30 s) into {directory}",
                  file=sys.stderr, flush=True)
        if changed:
            write_text(path, source)
        with build_guard(directory), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cpp_extension.load(name, sources=[str(path)], is_python_module=False, extra_cflags=list(cflags),
                               extra_ldflags=list(ldflags), verbose=False)
    except (RuntimeError, OSError, ImportError) as error:  # no compiler or ninja, a failed build
        last = str(error).strip().splitlines()[-1][:200] if str(error).strip() else ""
        return f"{what} did not build ({type(error).__name__}: {last})"
    if building:
        print(f"opus: built {what} in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return None


def load_ops(state: dict[str, Any], name: str, source: str, what: str, cflags: tuple[str, ...],
             ldflags: tuple[str, ...], fakes: dict[str, Callable[..., Any]]) -> str | None:
    """``build`` once per process (its answer kept in ``state["reason"]``) and, when built, each op's fake
    (shape-only) kernel for compiled graphs; None when the ops serve, else why not."""
    if "reason" not in state:
        reason = build(name, source, what, cflags, ldflags)
        if reason is None:
            for op, fake in fakes.items():
                torch.library.register_fake(op)(fake)
        state["reason"] = reason
    return state["reason"]


@contextmanager
def build_guard(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s build for this process: wait while another process builds there, then remove a
    lock file that torch's cpp_extension left behind.

    cpp_extension marks a build with a lock file and waits, without end, while one exists; a build killed
    outright (SIGKILL: a stage's watchdog, the OOM killer) leaves it, and every later load would hang. This
    guard is an flock, which the kernel releases when its holder dies; so whoever holds it knows that no
    build is running, and a lock file found then is a dead build's."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "opus-build.lock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        left = directory / "lock"
        if left.exists():
            left.unlink(missing_ok=True)
            print(f"opus: removed {left}, left by a build that did not finish", file=sys.stderr, flush=True)
        yield


def library_name(name: str) -> str:
    """The build's name; with the torch version in it, a build cached for another torch is never loaded."""
    return name + "_" + re.sub(r"\W", "_", torch.__version__)


def is_built(name: str) -> bool:
    """Whether a build of ``name`` (a ``library_name``) is cached (torch's cpp_extension then only loads it)."""
    from torch.utils import cpp_extension

    try:
        return os.path.exists(os.path.join(cpp_extension._get_build_directory(name, verbose=False), f"{name}.so"))
    except (OSError, RuntimeError):
        return False
