"""``opus serve``: a run's model behind an OpenAI-compatible HTTP server with continuous batching.

``kv_blocks`` (the block pool and the view a forward pass writes through), ``blocks`` (which request
owns which block; the prefix cache), ``steps`` (the compiled decode step per batch bucket), ``engine``
(the loop that owns the model), ``loader`` (run or export directory → engine), ``protocol``,
``prompts``, ``text`` (the OpenAI request bodies, prompts to ids, ids to streamed text), ``metrics``
(Prometheus) and ``app`` (FastAPI).
"""
