"""Opus: the overnight optimizer for PyTorch LLMs.

Mechanisms live here; stage types (thin adapters from YAML to these mechanisms) live in the
top-level ``stages`` package, which imports ``opus`` and never the reverse.
"""

__version__ = "0.1.0"
