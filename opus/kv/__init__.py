"""KV caches: one interface (``opus.kv.cache``: the protocol, the registry of kinds, the growing cache)
and its kinds, one module each: pooled (``pool``), static with a compiled decode step (``static``),
static with a CUDA-graph decode step (``cuda_graph``).

Importing a kind's module registers it. The line below does that for Opus's own kinds, and because
stage keys hash the code a stage reaches by import (opus.pipeline.code_reach), it also makes every
stage key cover them: a new kind is its module plus its name here.
"""

from opus.kv import choice, cuda_graph, pool, static  # noqa: F401 - registers the kinds (and the recipe step)

__all__ = ["choice", "cuda_graph", "pool", "static"]
