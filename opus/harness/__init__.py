"""lm-evaluation-harness as a consumer of what a run made.

- ``opus.harness.lm``: ``OpusLM``, the harness's model class ``opus`` (``opus lm-eval --model opus
  --model_args path=RUN_OR_EXPORT --tasks ...``): loglikelihood, rolling loglikelihood and generation
  through the run's formats, fusion and KV cache.
- ``opus.harness.tasks``: task files by path (relative data files resolved against the task file),
  written from a text folder (``opus tasks``): "which of four lines comes next" and "finish the line".
- ``opus.harness.compare``: a task run on the baseline and the candidate over the same samples, the
  accuracy drop with its 95 % interval from the sample count.

Imported only where used: ``lm_eval`` (the ``[lmeval]`` extra) is not needed by anything else.
"""
