"""The blocked causal attention's bf16 variant, ``opus_attention::causal_bf16``: C++ built into the same library
as opus.models.native_attention (which loads it and says when it cannot run).

The same blocks as the fp32 op, with the two products as AVX-512 BF16 dot products (``vdpbf16ps``: pairs of
bfloat16 multiplied, summed into fp32): Q, K and V rounded to bfloat16 (K in tiles of 16 keys, V in key pairs,
packed once per sequence and KV head), the scores, the softmax and the output in fp32, the softmax weights
rounded to bfloat16 for the second product and each row divided by the sum of its weights as rounded. At
K3's shape (8 query heads on 2 KV heads, head_dim 32, one 512-token prompt; AMD EPYC, 2 threads) 0.77 against
the fp32 op's 1.42 ms a layer. Lossy (about bfloat16's 2^-9 in each factor), so opus.kv's ``blocked_bf16``
kernel races only within a perplexity limit (opus.runtime.kv_fidelity).

The kernels are compiled for AVX-512 BF16 by a function attribute, not the build's flags, and run only where
``cpu_has_bf16`` (asked at run time) says the CPU has it; head sizes a multiple of 32.
"""

from __future__ import annotations

BF16_SOURCE = r"""
// ---- The same blocks with bf16 GEMMs (AVX-512 BF16 dot products, fp32 sums): Q, K, V and the softmax weights
// rounded to bfloat16, the scores, the softmax and the output in fp32. Lossy: kv_config measures its perplexity.
#if defined(__x86_64__) && defined(__GNUC__)
#define OPUS_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

bool cpu_has_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

// fp32 to bfloat16, rounded to nearest even (what the vector conversion does); NaN stays NaN.
inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

constexpr int64_t KEYS = 32;  // keys per score tile: two vectors of 16 lanes
constexpr int64_t CHUNK = 8;  // stacked query rows per micro-kernel call

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// One (sequence, KV head)'s keys and values in bf16, laid out for the dot products: keys in tiles of 16,
// each tile [D/2][16 keys][2 dims]; values in key pairs, [T/2][D][2 keys]. Keys past T are zero.
struct Packed {
  std::vector<uint16_t> keys, values;
};

void pack(const Rows& k, const Rows& v, int64_t b, int64_t kv, int64_t tokens, int64_t d, Packed& out) {
  const int64_t padded = round_up(tokens, KEYS);
  out.keys.assign(padded * d, 0);
  out.values.assign(padded * d, 0);
  for (int64_t j = 0; j < tokens; ++j) {
    const float* key = k.row(b, kv, j);
    const float* value = v.row(b, kv, j);
    uint16_t* tile = out.keys.data() + (j / 16) * 16 * d + (j % 16) * 2;
    uint16_t* pair = out.values.data() + (j / 2) * 2 * d + (j % 2);
    for (int64_t c = 0; c < d; ++c) {
      tile[(c / 2) * 32 + (c % 2)] = to_bf16(key[c]);
      pair[c * 2] = to_bf16(value[c]);
    }
  }
}

// Scores of R stacked query rows (bf16 pairs, ``qs`` apart) against the 32 keys of two tiles.
template <int R>
struct ScoresTile {
  OPUS_BF16 static void run(const uint32_t* q, int64_t qs, const uint16_t* tiles, int64_t d, float* s, int64_t ss) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint16_t* second = tiles + 16 * d;
    for (int64_t p = 0; p < d / 2; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(tiles + p * 32);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(second + p * 32);
      for (int r = 0; r < R; ++r) {
        const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * qs + p]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qp, k0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qp, k1);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(s + r * ss, acc[r][0]);
      _mm512_storeu_ps(s + r * ss + 16, acc[r][1]);
    }
  }
};

// Weighted values of R rows (bf16 weights, ``ps`` apart) over ``pairs`` key pairs, dims [c, c + 32).
template <int R>
struct ValuesTile {
  OPUS_BF16 static void run(const uint16_t* p, int64_t ps, const uint16_t* values, int64_t d, int64_t c,
                            int64_t pairs, float* o, int64_t os) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; ++j) {
      const __m512bh v0 = (__m512bh)_mm512_loadu_si512(values + (j * d + c) * 2);
      const __m512bh v1 = (__m512bh)_mm512_loadu_si512(values + (j * d + c + 16) * 2);
      for (int r = 0; r < R; ++r) {
        uint32_t w;
        std::memcpy(&w, p + r * ps + 2 * j, 4);
        const __m512bh wp = (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], wp, v0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], wp, v1);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(o + r * os + c, acc[r][0]);
      _mm512_storeu_ps(o + r * os + c + 16, acc[r][1]);
    }
  }
};

template <template <int> class Call, typename... Args>
void by_rows(int64_t rows, Args... args) {  // Call<R>::run for R = rows (1 to CHUNK)
  switch (rows) {
    case 8: Call<8>::run(args...); break;
    case 7: Call<7>::run(args...); break;
    case 6: Call<6>::run(args...); break;
    case 5: Call<5>::run(args...); break;
    case 4: Call<4>::run(args...); break;
    case 3: Call<3>::run(args...); break;
    case 2: Call<2>::run(args...); break;
    default: Call<1>::run(args...); break;
  }
}

// 2^x for x in [-126, 0] (x = n + f, |f| <= 1/2; 2^f by its degree-5 Taylor polynomial: relative error
// under 3e-6, far below bfloat16's 4e-3).
OPUS_BF16 inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-126.0f), x);  // a NaN score stays NaN (max returns its second operand)
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One score row's softmax weights over its ``visible`` keys, rounded to bf16, zero up to ``width``; returns
// the sum of the weights as rounded (the values are weighted by exactly these).
OPUS_BF16 float softmax_row_bf16(const float* s, int64_t visible, int64_t width, float scale, uint16_t* p) {
  __m512 most = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < visible; j += 16) {
    const __mmask16 m = visible - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (visible - j)) - 1);
    most = _mm512_mask_max_ps(most, m, most, _mm512_maskz_loadu_ps(m, s + j));
  }
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(most));
  const __m512 factor = _mm512_set1_ps(scale * 1.44269504088896341f);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const int64_t left = std::min<int64_t>(16, width - j);
    const __mmask16 store = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
    const int64_t seen = std::max<int64_t>(0, std::min<int64_t>(16, visible - j));
    const __mmask16 live = seen >= 16 ? 0xffff : static_cast<__mmask16>((1u << seen) - 1);
    const __m512 x = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), shift), factor);
    const __m256bh w = _mm512_cvtneps_pbh(_mm512_maskz_mov_ps(live, exp2_nonpositive(x)));
    sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(w));
    _mm256_mask_storeu_epi16(p + j, store, (__m256i)w);
  }
  return _mm512_reduce_add_ps(sum);
}

void block_bf16(const Rows& q, const std::vector<Packed>& packed, const Shape& s, int64_t b, int64_t kv,
                int64_t first, int64_t rows, std::vector<float>& scratch, std::vector<uint16_t>& halves,
                float* out) {
  const int64_t end = first + rows, stacked = s.group * rows, d = s.dim;
  const int64_t width = round_up(end, KEYS), pairs_width = round_up(end, 2);
  const Packed& kvp = packed[b * s.kv_heads + kv];
  scratch.resize(stacked * (width + d + 1));
  halves.resize(stacked * (d + pairs_width));
  float* scores = scratch.data();
  float* o = scores + stacked * width;
  float* inverse = o + stacked * d;
  uint16_t* qb = halves.data();
  uint16_t* weights = qb + stacked * d;
  for (int64_t r = 0; r < stacked; ++r) {  // the group's heads stacked: row g * rows + i
    const float* row = q.row(b, kv * s.group + r / rows, first + r % rows);
    for (int64_t c = 0; c < d; ++c) qb[r * d + c] = to_bf16(row[c]);
  }
  auto visible = [&](int64_t r) { return first + r % rows + 1; };
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int64_t r0 = 0; r0 < stacked; r0 += CHUNK) {
    const int64_t n = std::min(CHUNK, stacked - r0);
    int64_t most = 0;
    for (int64_t r = r0; r < r0 + n; ++r) most = std::max(most, visible(r));
    for (int64_t key = 0; key < most; key += KEYS) {
      by_rows<ScoresTile>(n, reinterpret_cast<const uint32_t*>(qb + r0 * d), d / 2,
                          kvp.keys.data() + key * d, d, scores + r0 * width + key, width);
    }
    for (int64_t r = r0; r < r0 + n; ++r) {
      inverse[r] = 1.0f / softmax_row_bf16(scores + r * width, visible(r), pairs_width, scale,
                                           weights + r * pairs_width);
    }
    for (int64_t c = 0; c < d; c += 32) {
      by_rows<ValuesTile>(n, weights + r0 * pairs_width, pairs_width,
                          kvp.values.data(), d, c, (most + 1) / 2, o + r0 * d, d);
    }
  }
  for (int64_t r = 0; r < stacked; ++r) {  // out is [B, T, H, D]
    const int64_t g = r / rows, t = first + r % rows;
    scaled_row(o + r * d, inverse[r], d, out + ((b * s.tokens + t) * s.heads + kv * s.group + g) * d);
  }
}

at::Tensor causal_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t block_rows) {
  TORCH_CHECK(cpu_has_bf16(), "opus_attention: causal_bf16 needs AVX-512 BF16, which this CPU lacks");
  const Shape s = checked_shape(q, k, v);
  TORCH_CHECK(s.dim % 32 == 0, "opus_attention: causal_bf16 needs a head size that is a multiple of 32");
  const at::Tensor qc = rows_contiguous(q), kc = rows_contiguous(k), vc = rows_contiguous(v);
  const Rows qr(qc), kr(kc), vr(vc);
  std::vector<Packed> packed(s.batch * s.kv_heads);
  at::parallel_for(0, s.batch * s.kv_heads, 1, [&](int64_t from, int64_t to) {
    for (int64_t i = from; i < to; ++i) pack(kr, vr, i / s.kv_heads, i % s.kv_heads, s.tokens, s.dim, packed[i]);
  });
  at::Tensor out = at::empty({s.batch, s.tokens, s.heads, s.dim}, q.options());
  float* outp = out.data_ptr<float>();
  over_blocks(s, block_rows, [&](int64_t b, int64_t kv, int64_t first, int64_t rows, std::vector<float>& scratch,
                                 std::vector<uint16_t>& halves) {
    block_bf16(qr, packed, s, b, kv, first, rows, scratch, halves, outp);
  });
  return out.permute({0, 2, 1, 3});
}
#else
bool cpu_has_bf16() { return false; }
at::Tensor causal_bf16(const at::Tensor& q, const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "opus_attention: causal_bf16 is built for x86-64 with GCC only");
  return q;
}
#endif
"""
