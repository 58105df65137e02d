"""The static-shape decoder the GPU benchmarks time (bench/h200.py, bench/cpu_static.py), reached by no stage.

``FastDecoder`` (fast_decoder) rebuilds an Opus decoder with stacked, fused and quantized linears
(qlinear) over the slot buffers of opus.kv.cuda_graph; ``StaticRunner`` (runner) runs it in static
shapes (CUDA graphs on a GPU); ``fidelity`` compares what it generates with opus.runtime.engine. Its
MoE is the fuse stage's ``GroupedMoE`` (opus.fusion.moe). A stage that wants it takes it from here.
"""
