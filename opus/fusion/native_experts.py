"""The sorted MoE experts mode for W8A8 experts on the CPU as one C++ op: no Python between the kernels.

At one 512-token prompt a K3 layer's experts are eight small int8 GEMM pairs (about 130 rows each, 256 by
384 and 192 by 256). The GEMMs take ~0.55 ms of the layer; run from Python (the sorted mode) the layer took
~3.6 ms, and as one compiled function per expert (the compiled mode) ~2.4 ms: the rest was the calls
around the kernels, each one a Python frame or a compiled region's guards (AMD EPYC with AVX-512 VNNI, 2
threads). Here the routing sort, the gather, each expert's per-token quantization, GEMMs, SwiGLU and
routing weight, and the sum into the output are one op (``opus_experts::w8a8_sorted``) whose kernel calls
ATen's ops from C++; elementwise steps run once over every expert's rows together.

It computes what the eager sorted mode computes, op for op and in the same order (per-token int8
activations, ``_int_mm``, the activation scale then the weight's; the weight-only bf16 branch for an
expert with at most ``WEIGHT_ONLY_MAX_ROWS`` rows; the packed int8 GEMM where one is in use; each
token's experts summed in expert order), so the two agree to the last bit where ATen's silu rounds alike
in both (its 16-float vectors divide the intermediate size, as K3's 192; otherwise a row's tail takes its scalar
path, by how the rows fall on the threads, and an int8 step may differ): tests/fusion/test_native_experts.py.
Experts with a bias, per-tensor activations, a dtype other than fp32 or a device other than the CPU keep
the Python path; ``reason`` says why. Built once per machine (opus.cpp_build); ``OPUS_NATIVE_OPS=0``
or a failed build keeps the Python path too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from opus import cpp_build
from opus.quant import packed

NAME = "opus_native_experts"
SOURCE = r"""
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/argsort.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/round.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>

// Hot loops built for AVX-512, AVX2 and the baseline, picked when the library loads (not -march=native:
// a cached build must run on whatever CPU later loads it). Other CPUs build them once, for the baseline.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define OPUS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define OPUS_CLONES
#endif

namespace {
constexpr int64_t CHUNK = 256;  // rows per pass: an expert's intermediates stay in the caches
constexpr int64_t BLOCK_BYTES = 8 << 20;

// |v|'s largest: as unsigned bit patterns with the sign cleared (ordered as the magnitudes are, NaN on top,
// as torch's amax propagates it), which vectorizes where a float max reduction would not.
OPUS_CLONES float abs_max(const float* v, int64_t n) {
  uint32_t most = 0;
  for (int64_t j = 0; j < n; ++j) {
    uint32_t bits;
    std::memcpy(&bits, v + j, 4);
    most = std::max(most, bits & 0x7fffffffu);
  }
  float out;
  std::memcpy(&out, &most, 4);
  return out;
}

// int8_per_token (opus/quant/kernels.py) of one row: its scale, and round(v / scale) (half to even).
OPUS_CLONES float quantize_row(const float* v, int64_t n, int8_t* q) {
  float scale = std::max(abs_max(v, n), 1e-8f) / 127.0f;
  for (int64_t j = 0; j < n; ++j) q[j] = static_cast<int8_t>(std::nearbyint(v[j] / scale));
  return scale;
}

// The GEMM's int32 products back to floats: (acc * x_scale) * w_scale, as Int8DynamicLinear does.
OPUS_CLONES void dequantize_row(const int32_t* acc, float x_scale, const float* w_scale, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(acc[j]) * x_scale * w_scale[j];
}

OPUS_CLONES void scale_row(const float* product, float x_scale, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = product[j] * x_scale;
}

OPUS_CLONES void multiply_row(float* h, const float* up, int64_t n) {
  for (int64_t j = 0; j < n; ++j) h[j] *= up[j];
}

// One slot's share of the down projection: ((acc * x_scale) * w_scale) * weight, rounded op by op as the
// eager mode's dequantization and routing weight.
OPUS_CLONES void weigh_row(const int32_t* acc, float x_scale, const float* w_scale, float weight, int64_t n,
                           float* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(acc[j]) * x_scale * w_scale[j] * weight;
}

OPUS_CLONES void weigh_product_row(const float* y, float weight, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = y[j] * weight;
}

// out = (0 + slot_1) + slot_2 + ..., the slots in expert order, as the eager mode's index_add sums them.
OPUS_CLONES void sum_rows(const float* slots, const int64_t* positions, int64_t k, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = 0.0f;
  for (int64_t s = 0; s < k; ++s) {
    const float* y = slots + positions[s] * n;
    for (int64_t j = 0; j < n; ++j) out[j] += y[j];
  }
}

struct Layer {
  const at::Tensor& qweight;
  const at::Tensor& scale;  // [1, out] fp32
  const at::Tensor& scale_bf16;
};

// One expert's layer on r rows, as Int8DynamicLinear.matmul: the weight-only bf16 branch up to
// ``weight_only_max_rows`` rows (``dense()`` gives the rows in fp32), else the int8 GEMM of ``q``. Returns true
// with the int8 GEMM's int32 sums in ``acc`` (the caller dequantizes them with what it does next), false with
// the fp32 product in ``out``.
template <typename Dense>
bool project(const Dense& dense, const at::Tensor& q, const float* x_scale, const Layer& layer,
             int64_t weight_only_max_rows, const std::string& packed, int64_t expert_rows, at::Tensor& acc,
             at::Tensor& out) {
  const int64_t r = q.size(0), n = layer.qweight.size(0);
  if (expert_rows <= weight_only_max_rows) {
    at::Tensor x = dense();
    out.copy_(x.size(1) % 16 == 0
        ? at::_weight_int8pack_mm(x.to(at::kBFloat16), layer.qweight, layer.scale_bf16).to(at::kFloat)
        : x.matmul(layer.qweight.to(at::kFloat).t()).mul(layer.scale));
    return false;
  }
  if (!packed.empty()) {  // the packed kernel's fp32 product already carries the weight's scales
    static const auto& ops = *new std::unordered_map<std::string, c10::OperatorHandle>{
        {"onednn", c10::Dispatcher::singleton().findSchemaOrThrow("opus::onednn_int8_linear", "")},
        {"fbgemm", c10::Dispatcher::singleton().findSchemaOrThrow("opus::fbgemm_int8_linear", "")}};
    torch::jit::Stack stack{q, layer.qweight, layer.scale};
    ops.at(packed).callBoxed(&stack);
    at::Tensor product = stack[0].toTensor().contiguous();
    const float* p = product.const_data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t i = 0; i < r; ++i) scale_row(p + i * n, x_scale[i], n, o + i * n);
    return false;
  }
  at::_int_mm_out(acc, q, layer.qweight.t());
  return true;
}

// One thread's buffers for a piece of an expert's rows (at most CHUNK).
struct Scratch {
  at::Tensor xq, gate_up, h, hq, y, acc_up, acc_down;
  std::vector<float> x_scale, h_scale;
  Scratch(int64_t rows, int64_t hidden, int64_t inter, const at::TensorOptions& f32)
      : xq(at::empty({rows, hidden}, f32.dtype(at::kChar))), gate_up(at::empty({rows, 2 * inter}, f32)),
        h(at::empty({rows, inter}, f32)), hq(at::empty({rows, inter}, f32.dtype(at::kChar))),
        y(at::empty({rows, hidden}, f32)), acc_up(at::empty({rows, 2 * inter}, f32.dtype(at::kInt))),
        acc_down(at::empty({rows, hidden}, f32.dtype(at::kInt))), x_scale(rows), h_scale(rows) {}
};

struct Experts {
  at::TensorList up_q, up_s, up_s16, down_q, down_s, down_s16;
  int64_t weight_only_max_rows;
  std::string packed;
};

// Rows [first, first + r) of the expert-sorted slots, all routed to expert e (``expert_rows`` in all), into
// ``slots`` (their weighted outputs, sorted order).
void piece(const at::Tensor& x, const at::Tensor& token, const float* slot_w, const Experts& ex, int64_t e,
           int64_t expert_rows, int64_t first, int64_t r, Scratch& s, float* slots) {
  const int64_t hidden = x.size(1), inter = ex.up_q[e].size(0) / 2;
  const int64_t* tok = token.const_data_ptr<int64_t>();
  const float* xp = x.const_data_ptr<float>();
  at::Tensor xq = s.xq.narrow(0, 0, r), gate_up = s.gate_up.narrow(0, 0, r), acc_up = s.acc_up.narrow(0, 0, r);
  int8_t* xqp = xq.data_ptr<int8_t>();
  for (int64_t i = 0; i < r; ++i) s.x_scale[i] = quantize_row(xp + tok[first + i] * hidden, hidden, xqp + i * hidden);
  auto gathered = [&] { return x.index_select(0, token.narrow(0, first, r)); };
  if (project(gathered, xq, s.x_scale.data(), {ex.up_q[e], ex.up_s[e], ex.up_s16[e]}, ex.weight_only_max_rows,
              ex.packed, expert_rows, acc_up, gate_up)) {
    const int32_t* a = acc_up.const_data_ptr<int32_t>();
    const float* w = ex.up_s[e].const_data_ptr<float>();
    float* g = gate_up.data_ptr<float>();
    for (int64_t i = 0; i < r; ++i) dequantize_row(a + i * 2 * inter, s.x_scale[i], w, 2 * inter, g + i * 2 * inter);
  }
  // SwiGLU (ATen's silu, vectorized as the eager mode's), then int8_per_token of it.
  at::Tensor h = s.h.narrow(0, 0, r), hq = s.hq.narrow(0, 0, r), acc_down = s.acc_down.narrow(0, 0, r);
  at::silu_out(h, gate_up.narrow(1, 0, inter));
  float* hp = h.data_ptr<float>();
  const float* gup = gate_up.const_data_ptr<float>();
  int8_t* hqp = hq.data_ptr<int8_t>();
  for (int64_t i = 0; i < r; ++i) {
    multiply_row(hp + i * inter, gup + i * 2 * inter + inter, inter);
    s.h_scale[i] = quantize_row(hp + i * inter, inter, hqp + i * inter);
  }
  at::Tensor y = s.y.narrow(0, 0, r);
  float* out = slots + first * hidden;
  if (project([&] { return h; }, hq, s.h_scale.data(), {ex.down_q[e], ex.down_s[e], ex.down_s16[e]},
              ex.weight_only_max_rows, ex.packed, expert_rows, acc_down, y)) {
    const int32_t* a = acc_down.const_data_ptr<int32_t>();
    const float* w = ex.down_s[e].const_data_ptr<float>();
    for (int64_t i = 0; i < r; ++i) {
      weigh_row(a + i * hidden, s.h_scale[i], w, slot_w[first + i], hidden, out + i * hidden);
    }
  } else {
    const float* yp = y.const_data_ptr<float>();
    for (int64_t i = 0; i < r; ++i) weigh_product_row(yp + i * hidden, slot_w[first + i], hidden, out + i * hidden);
  }
}

// The experts on one block of tokens, their sum into ``out`` (the block's rows); ``slots`` holds at least
// the block's [tokens * k, hidden] weighted expert outputs.
void sorted_block(const at::Tensor& x, const at::Tensor& chosen, const at::Tensor& weights, const Experts& ex,
                  float* slotp, at::Tensor out) {
  const int64_t experts = static_cast<int64_t>(ex.up_q.size()), hidden = x.size(1);
  const int64_t inter = ex.up_q[0].size(0) / 2, tokens = x.size(0), top_k = chosen.size(1);
  at::Tensor flat = chosen.reshape({-1});
  at::Tensor order = at::argsort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false).contiguous();
  at::Tensor token = order.div(top_k, "floor").contiguous();
  at::Tensor slot_weight = weights.reshape({-1}).to(at::kFloat).index_select(0, order).contiguous();
  at::Tensor counts = at::bincount(flat, {}, experts).contiguous();
  const int64_t* count = counts.const_data_ptr<int64_t>();
  // The work: each expert's rows in pieces of at most CHUNK, every piece independent of the others.
  std::vector<std::array<int64_t, 3>> pieces;  // expert, first row, rows
  for (int64_t e = 0, start = 0; e < experts; start += count[e], ++e) {
    for (int64_t first = start; first < start + count[e]; first += CHUNK) {
      pieces.push_back({e, first, std::min(CHUNK, start + count[e] - first)});
    }
  }
  const float* slot_w = slot_weight.const_data_ptr<float>();
  std::atomic<size_t> next{0};
  auto work = [&](int64_t, int64_t) {
    Scratch scratch(CHUNK, hidden, inter, x.options());
    for (size_t p = next++; p < pieces.size(); p = next++) {
      const auto& [e, first, r] = pieces[p];
      piece(x, token, slot_w, ex, e, count[e], first, r, scratch, slotp);
    }
  };
  // Pieces share out over the threads, each piece's GEMMs on one thread. A packed kernel's op may be Python's
  // (where its C++ kernel did not build), which must not be called from a worker thread: one thread then.
  const int64_t threads = ex.packed.empty() ? std::min<int64_t>(at::get_num_threads(), pieces.size()) : 1;
  if (threads > 1) {
    at::parallel_for(0, threads, 1, work);
  } else {
    work(0, 1);
  }
  // Each token sums its slots in expert order: their sorted positions, ascending.
  std::vector<int64_t> position(flat.size(0));
  const int64_t* ord = order.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.size(0); ++i) position[ord[i]] = i;
  float* outp = out.data_ptr<float>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, 16384 / hidden), [&](int64_t a, int64_t b) {
    std::vector<int64_t> mine(top_k);
    for (int64_t t = a; t < b; ++t) {
      std::copy(position.begin() + t * top_k, position.begin() + (t + 1) * top_k, mine.begin());
      std::sort(mine.begin(), mine.end());
      sum_rows(slotp, mine.data(), top_k, hidden, outp + t * hidden);
    }
  });
}

at::Tensor w8a8_sorted(const at::Tensor& x_in, const at::Tensor& chosen, const at::Tensor& weights,
                       at::TensorList up_q, at::TensorList up_s, at::TensorList up_s16,
                       at::TensorList down_q, at::TensorList down_s, at::TensorList down_s16,
                       int64_t weight_only_max_rows, std::string packed) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "opus_experts: x must be [N, H] fp32");
  const at::Tensor x = x_in.contiguous();
  const Experts ex{up_q, up_s, up_s16, down_q, down_s, down_s16, weight_only_max_rows, packed};
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = chosen.size(1);
  at::Tensor out = at::empty_like(x);
  // Tokens in blocks whose weighted expert outputs take at most BLOCK_BYTES: one buffer, reused, stays in
  // the caches' reach (measured on K3: one block for 16k tokens ran the op 25 % slower than inductor's graph).
  const int64_t block = std::max<int64_t>(1, BLOCK_BYTES / (top_k * hidden * 4));
  at::Tensor slots = at::empty({std::min(block, tokens) * top_k, hidden}, x.options());
  for (int64_t first = 0; first < tokens; first += block) {
    const int64_t n = std::min(block, tokens - first);
    sorted_block(x.narrow(0, first, n), chosen.narrow(0, first, n), weights.narrow(0, first, n), ex,
                 slots.data_ptr<float>(), out.narrow(0, first, n));
  }
  return out;
}
}  // namespace

TORCH_LIBRARY(opus_experts, m) {
  m.def("w8a8_sorted(Tensor x, Tensor chosen, Tensor weights, Tensor[] up_q, Tensor[] up_s, Tensor[] up_s16, "
        "Tensor[] down_q, Tensor[] down_s, Tensor[] down_s16, int weight_only_max_rows, str packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(opus_experts, CPU, m) {
  m.impl("w8a8_sorted", TORCH_FN(w8a8_sorted));
}
"""

_STATE: dict[str, Any] = {}  # "reason": why the op is not in use (None: it is)


@torch.compiler.assume_constant_result  # a compiled graph that meets it asks once, while traced
def load() -> str | None:
    """Build (once per machine) and load the op; None when it serves, else why not."""
    # -fopenmp: at::parallel_for is inline OpenMP, serial without it; libgomp.so.1 resolves to the copy
    # torch has loaded. -ffp-contract=off: no fused multiply-adds, so the products round as the eager ops'.
    return cpp_build.load_ops(_STATE, NAME, SOURCE, "the C++ op of the W8A8 MoE experts",
                              ("-O3", "-fopenmp", "-ffp-contract=off", "-Wno-psabi"), ("-fopenmp",),
                              {"opus_experts::w8a8_sorted": _fake})


def _fake(x: torch.Tensor, *_: Any) -> torch.Tensor:
    return torch.empty_like(x)


def experts_reason(gate_up: nn.Module, down: nn.Module) -> str | None:
    """Why the op cannot run these stacked experts whatever the input, or None when their format fits."""
    from opus.quant.formats.w8a8 import Int8DynamicLinear

    layers = [*gate_up.experts, *down.experts] if hasattr(gate_up, "experts") and hasattr(down, "experts") else []
    if not layers or any(type(layer) is not Int8DynamicLinear for layer in layers):
        return "the C++ experts op runs W8A8 experts only"
    if any(not layer.per_token or layer.bias is not None for layer in layers):
        return "the C++ experts op runs per-token W8A8 experts without a bias"
    return None


def input_reason(x: torch.Tensor) -> str | None:
    """Why the op cannot run on ``x`` (experts_reason said None), or None when it can (built: load())."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return f"the C++ experts op runs fp32 on the CPU, not {x.dtype} on {x.device.type}"
    return load()


def sorted_w8a8(gate_up: nn.Module, down: nn.Module, x: torch.Tensor, chosen: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """The sorted mode of these W8A8 experts (``reason`` said None), as the C++ op; traceable by dynamo,
    which reads the weight-only threshold and the packed kernel in use now, as the Python path does."""
    from opus.quant.formats.w8a8 import Int8DynamicLinear

    kernel = packed.active()
    ups, downs = gate_up.experts, down.experts
    return torch.ops.opus_experts.w8a8_sorted(
        x, chosen, weights.to(x.dtype),
        [m.qweight for m in ups], [m.scale for m in ups], [m._scale_bf16 for m in ups],
        [m.qweight for m in downs], [m.scale for m in downs], [m._scale_bf16 for m in downs],
        Int8DynamicLinear.WEIGHT_ONLY_MAX_ROWS, kernel.name if kernel is not None else "")
