"""KV caches: one interface (``opus.kv.cache``) and its kinds: growing (built in), pooled (``pool``),
static preallocated with a compiled decode step (``static``), and the CUDA-graph buffer (``cuda_graph``)."""
