"""The static-shape CUDA path for Opus decoder models (also runs, uncaptured, on CPU for testing).

    from opus.gpu import FastDecoder, StaticRunner
    runner = StaticRunner(model, batch_size=32, max_seq_len=640, quant=None)   # quant: fp8 | w8a8 | w4a16
    result = runner.generate(prompt_ids, new_tokens=128)

Pieces: ``StaticKVCache`` (preallocated, written in place at a position tensor), ``StackedExperts``
(MoE experts as batched / grouped matmuls), ``FastDecoder`` (the model rearranged: fused q/k/v,
optional quantized projections and experts), ``StaticRunner`` (buffers and CUDA-graph capture).
"""

from opus.gpu.experts import StackedExperts, grouped_mm_reason
from opus.gpu.fast import FastDecoder
from opus.gpu.runner import StaticRunner
from opus.kv.cuda_graph import StaticKVCache

__all__ = ["FastDecoder", "StackedExperts", "StaticKVCache", "StaticRunner", "grouped_mm_reason"]
