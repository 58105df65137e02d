"""The formats the planner can assign: a registry (``registry.py``) and one module per format family.

Callers look a format up — ``FORMATS[name].acts_quantized``, ``FORMATS[name].unsupported(linear, g)``,
``FORMATS[name].build(linear, g)`` — and never compare names. Adding a format: one module here that
subclasses ``Format`` and calls ``register``, plus its import line below; a format defined outside
opus (a plugin, a test) only needs ``register``.

The imports are static on purpose: stage cache keys hash the code a stage reaches by import
(``opus.pipeline.code_reach``), so a format module found by directory listing would not be hashed.
``tests/quant/test_formats.py`` fails if a module here is missing from this list.
"""

from __future__ import annotations

from opus.quant.formats import floats, fp8, w4a16, w8a8, w8a16  # noqa: F401 - each registers its formats
from opus.quant.formats.registry import (
    FORMATS,
    ExportMapping,
    Format,
    check_format,
    export_reference,
    is_noop,
    is_quantized,
    known,
    ladder,
    noop_name,
    promote,
    register,
    unregister,
)

# The built-in ladder, for readers; code calls ``ladder()``, which sees formats registered later too.
LADDER = ladder()

__all__ = ["FORMATS", "LADDER", "ExportMapping", "Format", "check_format", "export_reference", "is_noop",
           "is_quantized", "known", "ladder", "noop_name", "promote", "register", "unregister"]
