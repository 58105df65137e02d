"""The run engine: a pipeline file becomes a DAG of stages, each run in its own worker process,
checkpointed, gated, and resumed from its last good checkpoint.

The flow, one module each::

    spec (YAML -> PipelineSpec) -> graph (the DAG) -> registry (stage types) -> keys (what a stage
    depends on) -> runner (order, retries, rollbacks) -> supervise + worker (the stage in a child
    process, through contracts) -> context (what a stage sees) -> state (model = source + recipe +
    tensors) -> checkpoint (atomic, content-addressed) -> gates -> verdict -> summary

Imports run downwards only: this package uses the mechanisms (runtime, kv, quant, fusion, models)
through stage types and recipes; nothing below imports it.
"""
