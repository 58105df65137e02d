"""A decode step's attention over int8 K/V as the cache keeps it: ``opus_kv::int8_decode``, in C++.

A static cache with ``kv_dtype: int8`` (opus.kv.stored) keeps each (token, KV head)'s values as int8 with one
scale. Read through torch, a step widens every slot to float first (a full-size float copy of K and V a layer:
the bytes int8 was meant to save) and then runs two matmuls. This op reads the int8 bytes themselves: for each
sequence and KV head its query group's scores over the visible slots (16 slots at a time, each key row widened in
registers, the scale applied to the sum), a softmax, and the values weighted by probability times scale.

The source is compiled three times, for AVX-512, for AVX2 with FMA and for plain x86-64, and the CPU picks one
when the library loads (GCC's vector extensions, so one text serves all three; only the int8 widening is
written per build, in intrinsics). Built once per machine and torch
(opus.cpp_build); where it does not build, or for a shape it does not take (head_dim not 32, 64 or 128, a query
group over 16 heads, a dtype other than float32), ``opus.models.attention.narrow_kv_attention`` runs over the
widened values, as before.
"""

from __future__ import annotations

import torch

from opus import cpp_build

NAME = "opus_int8_kv"
HEAD_DIMS = (32, 64, 128)
MAX_GROUP = 16

_KERNEL = r"""
namespace @NS@ {
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
constexpr int64_t LANES = 16;

inline v16f splat(float x) { return v16f{} + x; }

inline v16f load(const float* p) {
  v16f x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

inline void store(float* p, v16f x) { std::memcpy(p, &x, sizeof x); }

// Sixteen int8 values as floats (@WIDEN_HOW@).
inline v16f widen(const int8_t* p) {
@WIDEN@
}

// e^x for x <= 0, 16 at a time in plain arithmetic: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6
// Taylor polynomial (relative error < 2e-7), 2^n written into the exponent bits; below -87 (e^x < 2^-125) 0.
// n is rounded by adding and subtracting 1.5 * 2^23, so this file must not be built with -ffast-math.
inline v16f exp_nonpositive(v16f x) {
  v16i under = x < -87.f;
  x = under ? splat(-87.f) : x;
  v16f n = (x * 1.44269504f + 12582912.f) - 12582912.f;
  v16f r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16f p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
  v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16f e = p * reinterpret_cast<v16f&>(bits);
  return under ? splat(0.f) : e;
}

// Lane j of the result: the sum of a[j]'s lanes. Halving twice over pairs: 15 shuffle-adds, not 16 reductions.
inline v16f lane_sums(v16f* a) {
  const v16i lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const v16i lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const v16i lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const v16i lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  auto pairs = [a](int n, v16i lo, int half) {
    for (int k = 0; k < n; ++k)
      a[k] = __builtin_shuffle(a[2 * k], a[2 * k + 1], lo) + __builtin_shuffle(a[2 * k], a[2 * k + 1], lo + half);
  };
  pairs(8, lo1, 8);
  pairs(4, lo2, 4);
  pairs(2, lo3, 2);
  return __builtin_shuffle(a[0], a[1], lo4) + __builtin_shuffle(a[0], a[1], lo4 + 1);
}

// One query row's group (q: group rows of D, out likewise) over `visible` int8 slots of one KV head; `hidden`
// marks slots before `visible` the mask keeps out (nullptr: none). scores: group * visible floats of scratch.
template <int64_t D>
void one_head(const float* __restrict q, int64_t group, const int8_t* __restrict k, const float* __restrict ks,
              const int8_t* __restrict v, const float* __restrict vs, int64_t visible, const uint8_t* hidden,
              float scale, float* __restrict scores, float* __restrict out) {
  constexpr int64_t C = D / LANES;
  v16f qv[MAX_GROUP * C];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < C; ++c) qv[g * C + c] = load(q + g * D + c * LANES) * scale;
  int64_t whole = visible / LANES * LANES;
  for (int64_t s = 0; s < whole; s += LANES) {
    v16f key_scale = load(ks + s);
    for (int64_t g = 0; g < group; ++g) {
      v16f dots[LANES];
      for (int64_t j = 0; j < LANES; ++j) {
        v16f acc = qv[g * C] * widen(k + (s + j) * D);
        for (int64_t c = 1; c < C; ++c) acc += qv[g * C + c] * widen(k + (s + j) * D + c * LANES);
        dots[j] = acc;
      }
      store(scores + g * visible + s, lane_sums(dots) * key_scale);
    }
  }
  for (int64_t s = whole; s < visible; ++s)
    for (int64_t g = 0; g < group; ++g) {
      float acc = 0.f;
      for (int64_t i = 0; i < D; ++i) acc += q[g * D + i] * scale * static_cast<float>(k[s * D + i]);
      scores[g * visible + s] = acc * ks[s];
    }
  if (hidden != nullptr)
    for (int64_t s = 0; s < visible; ++s)
      if (hidden[s])
        for (int64_t g = 0; g < group; ++g) scores[g * visible + s] = -INFINITY;
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * visible;
    v16f top16 = splat(-INFINITY);
    for (int64_t s = 0; s < whole; s += LANES) {
      v16f x = load(row + s);
      top16 = x > top16 ? x : top16;
    }
    float top = -INFINITY;
    for (int64_t j = 0; j < LANES; ++j) top = std::max(top, top16[j]);
    for (int64_t s = whole; s < visible; ++s) top = std::max(top, row[s]);
    v16f total16 = {};
    for (int64_t s = 0; s < whole; s += LANES) {
      v16f e = exp_nonpositive(load(row + s) - top);
      total16 += e;
      store(row + s, e);
    }
    float total = 0.f;
    for (int64_t j = 0; j < LANES; ++j) total += total16[j];
    for (int64_t s = whole; s < visible; ++s) {
      row[s] = std::exp(row[s] - top);
      total += row[s];
    }
    float inv = 1.f / total;
    for (int64_t s = 0; s < visible; ++s) row[s] *= inv * vs[s];
  }
  v16f acc[MAX_GROUP * C] = {};
  for (int64_t s = 0; s < visible; ++s) {
    v16f values[C];
    for (int64_t c = 0; c < C; ++c) values[c] = widen(v + s * D + c * LANES);
    for (int64_t g = 0; g < group; ++g) {
      float w = scores[g * visible + s];
      for (int64_t c = 0; c < C; ++c) acc[g * C + c] += w * values[c];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < C; ++c) store(out + g * D + c * LANES, acc[g * C + c]);
}

Head head_for(int64_t d) {
  return d == 32 ? one_head<32> : d == 64 ? one_head<64> : d == 128 ? one_head<128> : nullptr;
}
}  // namespace @NS@
"""

_SOURCE = r"""
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <string>
#include <vector>

namespace {
constexpr int64_t MAX_GROUP = @MAX_GROUP@;
using Head = void (*)(const float*, int64_t, const int8_t*, const float*, const int8_t*, const float*, int64_t,
                      const uint8_t*, float, float*, float*);
#pragma GCC push_options
#pragma GCC target("avx512f")
@AVX512@
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma")
@AVX2@
#pragma GCC pop_options
@PLAIN@

const char* BUILDS[] = {"plain", "avx2", "avx512"};

int widest_build() {
  if (__builtin_cpu_supports("avx512f")) return 2;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
}

std::atomic<int> build_index{widest_build()};  // the widest build this CPU runs, unless use_build asked for less

std::string build_in_use() { return BUILDS[build_index.load()]; }

// Run a narrower build ("avx2", "plain"; never wider than the CPU's): each build can be tested on one machine.
std::string use_build(const std::string& name) {
  for (int index = 0; index < 3; ++index)
    if (name == BUILDS[index]) build_index = std::min(index, widest_build());
  return build_in_use();
}

Head head_for(int64_t d) {
  int index = build_index.load();
  return index == 2 ? avx512::head_for(d) : index == 1 ? avx2::head_for(d) : plain::head_for(d);
}

// q [B, H, T, D] float32; k, v [B, KV, S, D] int8; k_scale, v_scale [B, KV, S, 1] float32; mask [T, S] bool
// (true: visible). Query head h reads KV head h / (H / KV).
at::Tensor int8_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& k_scale, const at::Tensor& v,
                       const at::Tensor& v_scale, const at::Tensor& mask) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(),
              "opus_kv::int8_decode: q [B, H, T, D], k and v [B, KV, S, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kChar && v.scalar_type() == at::kChar &&
              k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat &&
              mask.scalar_type() == at::kBool,
              "opus_kv::int8_decode: float32 q and scales, int8 k and v, a bool mask");
  const int64_t b = q.size(0), heads = q.size(1), t = q.size(2), d = q.size(3);
  const int64_t kv = k.size(1), slots = k.size(2);
  TORCH_CHECK(k.size(0) == b && k.size(3) == d && heads % kv == 0 && heads / kv <= MAX_GROUP,
              "opus_kv::int8_decode: shapes q ", q.sizes(), ", k ", k.sizes());
  TORCH_CHECK(k_scale.numel() == b * kv * slots && v_scale.numel() == b * kv * slots &&
              mask.numel() == t * slots,
              "opus_kv::int8_decode: one scale per slot and a [T, S] mask");
  Head head = head_for(d);
  TORCH_CHECK(head != nullptr, "opus_kv::int8_decode: head_dim 32, 64 or 128, got ", d);
  const int64_t group = heads / kv;
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  auto ksc = k_scale.contiguous(), vsc = v_scale.contiguous(), maskc = mask.contiguous();
  auto out = at::empty({b, heads, t, d}, q.options());
  // Per query row: the slots up to its last visible one, and whether any before it are hidden.
  std::vector<int64_t> visible(t, 0);
  std::vector<char> gaps(t, 0);
  const bool* m = maskc.data_ptr<bool>();
  for (int64_t r = 0; r < t; ++r) {
    int64_t seen = 0;
    for (int64_t s = 0; s < slots; ++s)
      if (m[r * slots + s]) { visible[r] = s + 1; ++seen; }
    gaps[r] = seen != visible[r];
  }
  const float* qp = qc.data_ptr<float>();
  const int8_t* kp = kc.data_ptr<int8_t>();
  const int8_t* vp = vc.data_ptr<int8_t>();
  const float* ksp = ksc.data_ptr<float>();
  const float* vsp = vsc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  at::parallel_for(0, b * kv * t, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * slots);
    std::vector<float> rows(group * d), outs(group * d);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t r = job % t, bh = job / t;  // bh: sequence * KV + KV head
      const int64_t first_head = (bh / kv) * heads + (bh % kv) * group;
      for (int64_t g = 0; g < group; ++g)
        std::memcpy(&rows[g * d], qp + ((first_head + g) * t + r) * d, d * sizeof(float));
      if (visible[r] == 0) {
        std::fill(outs.begin(), outs.end(), 0.f);
      } else {
        std::vector<uint8_t> hidden;  // only for a row with hidden slots before its last visible one
        if (gaps[r]) {
          hidden.resize(visible[r]);
          for (int64_t s = 0; s < visible[r]; ++s) hidden[s] = !m[r * slots + s];
        }
        head(rows.data(), group, kp + bh * slots * d, ksp + bh * slots, vp + bh * slots * d, vsp + bh * slots,
             visible[r], gaps[r] ? hidden.data() : nullptr, scale, scores.data(),
             outs.data());
      }
      for (int64_t g = 0; g < group; ++g)
        std::memcpy(op + ((first_head + g) * t + r) * d, &outs[g * d], d * sizeof(float));
    }
  });
  return out;
}
}  // namespace

TORCH_LIBRARY(opus_kv, m) {
  m.def("int8_decode(Tensor q, Tensor k, Tensor k_scale, Tensor v, Tensor v_scale, Tensor mask) -> "
        "Tensor");
  m.def("build_in_use() -> str", &build_in_use);
  m.def("use_build(str name) -> str", &use_build);
}

TORCH_LIBRARY_IMPL(opus_kv, CPU, m) { m.impl("int8_decode", TORCH_FN(int8_decode)); }
"""

# How each build widens 16 int8 values: the compiler, given a plain loop or a vector conversion, wrote a
# scalar convert per value there (GCC 12), so the two vector builds say it in intrinsics.
_WIDEN = {
    "avx512": ("one sign-extend, one convert", """
  __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<v16f>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));"""),
    "avx2": ("two of each", """
  __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  v16f x;
  std::memcpy(&x, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&x) + sizeof lo, &hi, sizeof hi);
  return x;"""),
    "plain": ("a plain loop", """
  float values[LANES];
  for (int64_t i = 0; i < LANES; ++i) values[i] = static_cast<float>(p[i]);
  return load(values);"""),
}

_STATE: dict[str, str | None] = {}  # "reason": why the op is not in use (None: it is)


def source() -> str:
    """The C++ text: the kernel three times (AVX-512, AVX2 + FMA, plain), the dispatch and the op."""
    text = _SOURCE.replace("@MAX_GROUP@", str(MAX_GROUP))
    for isa, (how, widen) in _WIDEN.items():
        kernel = _KERNEL.replace("@NS@", isa).replace("@WIDEN_HOW@", how).replace("@WIDEN@", widen)
        text = text.replace(f"@{isa.upper()}@", kernel)
    return text


def load() -> str | None:
    """Build (once per machine and torch) and load the op; None when it serves, else why not."""
    if "reason" not in _STATE:
        reason = cpp_build.build(NAME, source(), "the C++ attention over int8 K/V",
                                 cflags=("-O3", "-fopenmp", "-Wno-psabi"), ldflags=("-fopenmp",))
        if reason is None:
            torch.library.register_fake("opus_kv::int8_decode")(_shape_of)
        _STATE["reason"] = reason
    return _STATE["reason"]


def _shape_of(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, v: torch.Tensor, v_scale: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def build_in_use() -> str:
    """Which of the three builds this CPU runs: ``avx512``, ``avx2`` or ``plain`` (after ``load()``)."""
    return str(torch.ops.opus_kv.build_in_use())


def use_build(name: str) -> str:
    """Run the ``avx512``, ``avx2`` or ``plain`` build from now on (never one wider than the CPU runs); the
    build then in use. For testing each build on one machine."""
    return str(torch.ops.opus_kv.use_build(name))


def unsupported(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why the op does not take this query and cache (None: it does); ``load()`` is not asked."""
    if q.dtype != torch.float32 or q.device.type != "cpu":
        return f"a float32 query on the CPU, not {q.dtype} on {q.device.type}"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head_dim {q.shape[-1]} (the op takes {', '.join(map(str, HEAD_DIMS))})"
    if q.shape[1] // k.shape[1] > MAX_GROUP:
        return f"{q.shape[1] // k.shape[1]} query heads per KV head (the op takes up to {MAX_GROUP})"
    return None


def attention(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, v: torch.Tensor, v_scale: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    """``q [B, H, T, D]`` over int8 ``k, v [B, KV, S, D]`` with their per-slot scales where ``mask [T, S]`` lets
    it see; the caller has checked ``load()`` and ``unsupported``."""
    return torch.ops.opus_kv.int8_decode(q, k, k_scale, v, v_scale, mask)
