"""Opus: the overnight optimizer for PyTorch LLMs.

Mechanisms live here; stage types (thin adapters from YAML to these mechanisms) live in the
top-level ``stages`` package, which imports ``opus`` and never the reverse.

The Python API (``opus.api``): ``opus.run(pipeline, set=..., run_dir=...)`` runs a pipeline as
``opus run`` does and returns its summary; ``opus.load(run_or_export_dir)`` returns the model, its
tokenizer and ``generate(prompt)``. Both are imported on first use: ``import opus`` loads no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers; at run time __getattr__ imports opus.api on first use
    from opus.api import load, run

__version__ = "0.1.0"
__all__ = ["__version__", "load", "run"]
_API = ("run", "load")


def __getattr__(name: str) -> Any:
    # importlib, not an import statement: every stage's key hashes the code it reaches by import
    # (opus.pipeline.code_reach), and opus.api reaches the command line.
    if name in _API:
        return getattr(importlib.import_module("opus.api"), name)
    raise AttributeError(f"module 'opus' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
