"""The blocked causal prefill attention (opus.models.attention) as one C++ op on the CPU.

Run as torch ops, the blocked kernel is eight calls of torch's flash attention per layer at a 512-token
prompt, each with a boolean mask that the compiled graph builds and widens to a float bias first; at K3's
shapes (head_dim 32, 8 query heads on 2 KV heads, one 512-token prompt) that was half the compiled prefill:
flash attention 2.5 ms a layer and its masks another 0.6 (torch.profiler, AMD EPYC with AVX-512, 2 threads).

Here one op (``opus_attention::causal``) does what the blocked kernel does: each KV head's query group and
``BLOCK`` query positions at a time, against the keys up to the block's end and no further. For one such
block it takes the scores as one GEMM (ATen's, the rows of the group's heads stacked), the softmax of each
row over its visible keys (the keys after a query are never read: their weights are zero), and the
weighted values as a second GEMM, divided by each row's sum at the end. Blocks share out over the threads,
largest first; a block's arithmetic does not depend on which thread runs it, so the result is the same at
any thread count. It rounds as fp32 does, in its own order: not bit for bit torch's flash attention, within
fp32 rounding of it (tests/models/test_native_attention.py).

The output is ``[B, H, T, D]`` as a view of ``[B, T, H, D]`` memory, so the attention block's transpose
back to the hidden size is free. fp32 on the CPU only; anything else, ``OPUS_NATIVE_OPS=0`` or a failed build
keeps the blocked kernel's torch ops (``reason`` says why).

The same library holds the op's bf16 variant (opus.models.native_attention_bf16; ``causal(..., bf16=True)``),
which runs where ``bf16_reason`` says None.
"""

from __future__ import annotations

from typing import Any

import torch

from opus import cpp_build
from opus.models.native_attention_bf16 import BF16_SOURCE

NAME = "opus_native_attention"
BLOCK = 64  # query positions per block: the upper triangle's waste within a block is half a block of keys
SOURCE = r"""
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

// Hot loops built for AVX-512, AVX2 and the baseline, picked when the library loads (not -march=native:
// a cached build must run on whatever CPU later loads it). Other CPUs build them once, for the baseline.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define OPUS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define OPUS_CLONES
#endif

namespace {

// exp(x) for x <= 0 (a softmax's shifted scores), in a form the compiler vectorizes: x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by Cephes' degree-6 polynomial (about 1 ulp), 2^n into the exponent bits.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below this exp underflows; 2^n stays a normal float
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * r) * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return p * two_n;
}

// One score row over its ``visible`` keys into softmax weights (unnormalized), zero for the ``hidden`` keys
// after them; returns the weights' sum.
OPUS_CLONES float softmax_row(float* s, int64_t visible, int64_t hidden, float scale) {
  float most = s[0];
#pragma omp simd reduction(max : most)
  for (int64_t j = 0; j < visible; ++j) most = s[j] > most ? s[j] : most;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < visible; ++j) {
    s[j] = exp_nonpositive((s[j] - most) * scale);
    sum += s[j];
  }
  std::memset(s + visible, 0, sizeof(float) * hidden);
  return sum;
}

OPUS_CLONES void scaled_row(const float* o, float factor, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = o[j] * factor;
}

struct Shape {
  int64_t batch, heads, kv_heads, group, tokens, dim;
};

// An fp32 [B, H, T, D] tensor whose last dimension is contiguous: its rows by pointer (no tensor view per row).
struct Rows {
  float* data;
  int64_t batch, head, token;
  explicit Rows(const at::Tensor& x)
      : data(const_cast<float*>(x.const_data_ptr<float>())), batch(x.stride(0)), head(x.stride(1)),
        token(x.stride(2)) {}
  float* row(int64_t b, int64_t h, int64_t t) const { return data + b * batch + h * head + t * token; }
};

// ``x`` itself where its rows (last dimension) are contiguous, as Rows reads them; else a contiguous copy.
at::Tensor rows_contiguous(const at::Tensor& x) { return x.stride(3) == 1 ? x : x.contiguous(); }

// Query positions [first, first + rows) of KV head ``kv`` in sequence ``b``: every head of its group.
void block(const Rows& q, const Rows& k, const Rows& v, const Shape& s, int64_t b, int64_t kv, int64_t first,
           int64_t rows, std::vector<float>& scratch, float* out) {
  const int64_t end = first + rows, stacked = s.group * rows, d = s.dim;
  scratch.resize(stacked * (2 * d + end + 1));
  float* qs = scratch.data();
  float* scores = qs + stacked * d;
  float* o = scores + stacked * end;
  float* inverse = o + stacked * d;
  for (int64_t g = 0; g < s.group; ++g) {  // the group's heads stacked: row g * rows + i
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(qs + (g * rows + i) * d, q.row(b, kv * s.group + g, first + i), sizeof(float) * d);
    }
  }
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor keys = at::from_blob(k.row(b, kv, 0), {end, d}, {k.token, 1}, f32);
  at::Tensor values = at::from_blob(v.row(b, kv, 0), {end, d}, {v.token, 1}, f32);
  at::Tensor score = at::from_blob(scores, {stacked, end}, f32);
  at::mm_out(score, at::from_blob(qs, {stacked, d}, f32), keys.t());
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int64_t r = 0; r < stacked; ++r) {
    const int64_t visible = first + r % rows + 1;
    inverse[r] = 1.0f / softmax_row(scores + r * end, visible, end - visible, scale);
  }
  at::Tensor weighted = at::from_blob(o, {stacked, d}, f32);
  at::mm_out(weighted, score, values);
  for (int64_t r = 0; r < stacked; ++r) {  // out is [B, T, H, D]
    const int64_t g = r / rows, t = first + r % rows;
    scaled_row(o + r * d, inverse[r], d, out + ((b * s.tokens + t) * s.heads + kv * s.group + g) * d);
  }
}

Shape checked_shape(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "opus_attention: q, k, v must be [B, H, T, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "opus_attention: q, k, v must be fp32");
  const Shape s{q.size(0), q.size(1), k.size(1), q.size(1) / k.size(1), q.size(2), q.size(3)};
  TORCH_CHECK(s.heads % s.kv_heads == 0 && k.sizes() == v.sizes() && k.size(2) == s.tokens && k.size(3) == s.dim,
              "opus_attention: k, v must be [B, KV, T, D] with KV dividing q's heads");
  return s;
}

// Every (sequence, KV head, query block) through ``run``: blocks largest first (the last ones see the most
// keys), shared out as threads come free; each thread keeps its own scratch.
template <typename Run>
void over_blocks(const Shape& s, int64_t block_rows, const Run& run) {
  std::vector<std::array<int64_t, 3>> blocks;  // first, batch, kv head
  for (int64_t first = ((s.tokens - 1) / block_rows) * block_rows; first >= 0; first -= block_rows) {
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t kv = 0; kv < s.kv_heads; ++kv) blocks.push_back({first, b, kv});
    }
  }
  std::atomic<size_t> next{0};
  auto work = [&](int64_t, int64_t) {
    std::vector<float> scratch;
    std::vector<uint16_t> halves;
    for (size_t i = next++; i < blocks.size(); i = next++) {
      const auto& [first, b, kv] = blocks[i];
      run(b, kv, first, std::min(block_rows, s.tokens - first), scratch, halves);
    }
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), blocks.size());
  if (threads > 1) {
    at::parallel_for(0, threads, 1, work);
  } else {
    work(0, 1);
  }
}

at::Tensor causal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t block_rows) {
  const Shape s = checked_shape(q, k, v);
  at::Tensor out = at::empty({s.batch, s.tokens, s.heads, s.dim}, q.options());
  const at::Tensor qc = rows_contiguous(q), kc = rows_contiguous(k), vc = rows_contiguous(v);
  const Rows qr(qc), kr(kc), vr(vc);
  float* outp = out.data_ptr<float>();
  over_blocks(s, block_rows, [&](int64_t b, int64_t kv, int64_t first, int64_t rows, std::vector<float>& scratch,
                                 std::vector<uint16_t>&) { block(qr, kr, vr, s, b, kv, first, rows, scratch, outp); });
  return out.permute({0, 2, 1, 3});
}

""" + BF16_SOURCE + r"""}  // namespace

TORCH_LIBRARY(opus_attention, m) {
  m.def("causal(Tensor q, Tensor k, Tensor v, int block) -> Tensor");
  m.def("causal_bf16(Tensor q, Tensor k, Tensor v, int block) -> Tensor");
  m.def("cpu_has_bf16() -> bool", &cpu_has_bf16);
}

TORCH_LIBRARY_IMPL(opus_attention, CPU, m) {
  m.impl("causal", TORCH_FN(causal));
  m.impl("causal_bf16", TORCH_FN(causal_bf16));
}
"""

_STATE: dict[str, Any] = {}  # "reason": why the op is not in use (None: it is)


@torch.compiler.assume_constant_result  # a compiled graph that meets it asks once, while traced
def load() -> str | None:
    """Build (once per machine) and load the op; None when it serves, else why not."""
    # -fopenmp: at::parallel_for is inline OpenMP (serial without it) and the softmax's `omp simd` reductions
    # vectorize; libgomp.so.1 resolves to the copy torch has loaded.
    return cpp_build.load_ops(_STATE, NAME, SOURCE, "the C++ op of the blocked causal attention",
                              ("-O3", "-fopenmp", "-fno-math-errno", "-Wno-psabi"), ("-fopenmp",),
                              {"opus_attention::causal": _fake, "opus_attention::causal_bf16": _fake})


def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
    b, heads, t, d = q.shape
    return q.new_empty((b, t, heads, d)).permute(0, 2, 1, 3)


def reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the op cannot run this causal prefill, or None when it can (and is built: load())."""
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in (q, k, v)):
        return f"the C++ attention op runs fp32 on the CPU, not {q.dtype} on {q.device.type}"
    return load()


def bf16_reason(dtype: torch.dtype, device: torch.device | str, head_dim: int | None) -> str | None:
    """Why the op's bf16 variant cannot run a model of this dtype, device and head size here, or None."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return f"the bf16 attention op runs fp32 models on the CPU, not {dtype} on {torch.device(device).type}"
    if head_dim is None or head_dim % 32:
        return f"the bf16 attention op takes a head size that is a multiple of 32, not {head_dim}"
    if (why := load()) is not None:
        return why
    if not cpu_has_bf16():
        return "this CPU has no AVX-512 BF16 (the bf16 attention op's dot products)"
    return None


@torch.compiler.assume_constant_result
def cpu_has_bf16() -> bool:
    """Whether this CPU runs the bf16 variant (AVX-512 BF16, BW, VL, DQ); the op is loaded (load() said None)."""
    if "bf16" not in _STATE:
        _STATE["bf16"] = bool(torch.ops.opus_attention.cpu_has_bf16())
    return bool(_STATE["bf16"])


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """Causal attention of ``q [B, H, T, D]`` over its own ``k, v [B, KV, T, D]`` (``reason`` said None; with
    ``bf16``, ``bf16_reason`` too): fp32 throughout, or Q, K, V and the softmax weights rounded to bfloat16 for
    the two products (fp32 sums, softmax and output)."""
    if bf16:
        return torch.ops.opus_attention.causal_bf16(q, k, v, BLOCK)
    return torch.ops.opus_attention.causal(q, k, v, BLOCK)
