"""Linear layers for the static CUDA-graph path (``qlinear``: fusing float linears, quantizing them).

The rest of the former static path lives in its rooms: the slot buffers and the CUDA-graph cache kind
in opus.kv.cuda_graph, ``FastDecoder`` and ``StaticRunner`` in opus.fusion (``fast_decoder``,
``static_runner``), whose MoE is the fuse stage's ``GroupedMoE`` (opus.fusion.moe). This package sits
below opus.fusion.
"""
