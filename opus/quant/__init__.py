"""Quantization: real low-precision kernels, SmoothQuant, calibration, sensitivity and the planner.

Formats are a registry (``opus.quant.formats``; callers look up ``FORMATS[name]``, never compare
names): fp32 (the no-op) and bf16/fp16 kept as float; w8a16 and w4a16 weight-only (int8 per channel,
int4 group-wise); w8a8 (SmoothQuant, per-token dynamic int8 activations, per-channel int8 weights,
int8×int8 GEMM); w8a8_tensor (naive per-tensor activations, for comparison); fp8 (E4M3 rowwise, CUDA
only). Each format module owns its kernel module; fake quantization exists only for sensitivity scores.
"""
