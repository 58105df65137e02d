"""C++ kernels for the packed int8 GEMM ops (opus.quant.packed): no call into Python per GEMM.

A compiled step calls ``opus::<kernel>_int8_linear`` from inductor's C++ wrapper through the dispatcher.
With the op's kernel written in Python, every call takes the GIL, boxes its tensors into Python objects,
finds the twin in a Python table and calls the library's op back through the dispatcher. Here the same
ops get C++ kernels that find the twin in a C++ table and call FBGEMM's or oneDNN's op directly. In a
compiled graph (``bench/packed_calls.py``, Intel Xeon with AMX, 2 threads), a call at one row on the
135M shape's 576 x 576 took 31.1 µs through the Python kernel and 15.5 through the C++ one with FBGEMM
(53.8 and 39.8 with oneDNN); K3's expert at prefill (512 x 256 by 384, oneDNN) 88.2 and 82.6 µs.

The kernels are built once per machine and torch (opus.cpp_build) when a packed kernel is first put to use,
and serve those ops for the rest of the process (the Python kernels are registered only where the build
fails). Twins stay owned by the Python table (``PackedKernel.twins``): the C++ table holds a reference,
dropped when the weight goes. A weight the C++ table does not know yet (the first call) is packed through
``opus::<kernel>_pack``, the Python packing, once. Where the build fails the Python
kernels stay, and ``load()`` says why, once.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from opus import cpp_build

NAME = "opus_packed_native"
SOURCE = r"""
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>
#include <mutex>
#include <string>
#include <unordered_map>

namespace {
std::mutex lock;
std::unordered_map<std::string, std::unordered_map<const c10::TensorImpl*, c10::IValue>> twins;

c10::IValue twin_of(const std::string& kernel, const at::Tensor& qweight, const at::Tensor& scale) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    {
      std::lock_guard<std::mutex> guard(lock);
      auto& table = twins[kernel];
      auto found = table.find(qweight.unsafeGetTensorImpl());
      if (found != table.end()) return found->second;
    }
    // Not packed yet: opus::<kernel>_pack (Python) packs it and hands it to remember().
    auto pack = c10::Dispatcher::singleton().findSchemaOrThrow(("opus::" + kernel + "_pack").c_str(), "");
    torch::jit::Stack stack{qweight, scale};
    pack.callBoxed(&stack);
  }
  TORCH_CHECK(false, "opus: no ", kernel, " twin for this weight after packing it");
}

at::Tensor fbgemm_int8_linear(const at::Tensor& q, const at::Tensor& qweight, const at::Tensor& scale) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(
      "quantized::linear_with_input_q_dq_qweight_dq_output_fp32", "");
  torch::jit::Stack stack{q.scalar_type() == at::kFloat ? q : q.to(at::kFloat), 1.0, int64_t{128},
                          twin_of("fbgemm", qweight, scale)};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor onednn_int8_linear(const at::Tensor& q, const at::Tensor& qweight, const at::Tensor& scale) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qlinear_pointwise", "");
  auto twin = twin_of("onednn", qweight, scale).toTuple();
  // One row as two: oneDNN 3.12's slow path for one row at small K (see opus/quant/onednn.py).
  bool one = q.size(0) == 1;
  at::Tensor rows = one ? q.expand({2, q.size(1)}).contiguous() : q;
  torch::jit::Stack stack{rows, 1.0, int64_t{0}, twin->elements()[0], twin->elements()[2], twin->elements()[1],
                          c10::IValue(), 1.0, int64_t{0}, c10::IValue(at::kFloat), std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  at::Tensor out = stack[0].toTensor();
  return one ? out.narrow(0, 0, 1) : out;
}

void remember(const std::string& kernel, const at::Tensor& qweight, const c10::IValue& twin) {
  std::lock_guard<std::mutex> guard(lock);
  twins[kernel][qweight.unsafeGetTensorImpl()] = twin;
}

int64_t forget(const std::string& kernel, int64_t impl) {
  std::lock_guard<std::mutex> guard(lock);
  return static_cast<int64_t>(twins[kernel].erase(reinterpret_cast<const c10::TensorImpl*>(impl)));
}
}  // namespace

TORCH_LIBRARY(opus_native, m) {
  m.def("remember(str kernel, Tensor qweight, Any twin) -> ()", &remember);
  m.def("forget(str kernel, int impl) -> int", &forget);
}

TORCH_LIBRARY_IMPL(opus, CPU, m) {
  m.impl("fbgemm_int8_linear", TORCH_FN(fbgemm_int8_linear));
  m.impl("onednn_int8_linear", TORCH_FN(onednn_int8_linear));
}
"""

_STATE: dict[str, Any] = {}  # "reason": why the C++ kernels are not in use (None: they are)


def load() -> str | None:
    """Build (once per machine) and load the C++ kernels; None when they serve, else why not (the Python
    kernels then stay). ``OPUS_NATIVE_OPS=0`` keeps the Python kernels."""
    if "reason" not in _STATE:
        _STATE["reason"] = _build()
    return _STATE["reason"]


def _build() -> str | None:
    reason = cpp_build.build(NAME, SOURCE, "the C++ kernels of the packed int8 GEMMs")
    return None if reason is None else f"{reason}; Python kernels serve"


def remember(kernel: str, qweight: torch.Tensor, twin: Any) -> None:
    """Hand ``twin`` to the C++ table (when loaded); it is dropped there when ``qweight`` goes."""
    if _STATE.get("reason", "not loaded") is not None:
        return
    torch.ops.opus_native.remember(kernel, qweight, twin)
    weakref.finalize(qweight, torch.ops.opus_native.forget, kernel, qweight._cdata)
