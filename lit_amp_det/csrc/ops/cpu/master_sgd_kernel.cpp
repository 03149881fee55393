// CPU kernels of lit_amp_det::master_sgd_step_ and lit_amp_det::all_finite (semantics: csrc/README.md).
//
// Every tensor of a parameter (master, gradient, momentum, low-precision weight) has the same strides and is
// dense, so the four are walked as flat arrays in memory order whatever the layout (channels_last weights
// included). Each chunk of a tensor is widened to fp32 in an L1-sized buffer, updated, and narrowed again;
// the loops that do the arithmetic are compiled for AVX-512, AVX2 and the baseline (GCC's target_clones picks
// one when the library loads), so the package still loads on any x86-64 CPU.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "bf16_bits.h"
#include "multiversion.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace lit_amp_det {
namespace ops {

namespace {

constexpr int64_t kChunk = 1024;  // elements widened at a time: 4 KB of fp32 per buffer, in L1
constexpr int64_t kGrain = 16 * kChunk;  // elements per task of at::parallel_for

struct SgdOptions {
  float lr, momentum, dampening, weight_decay, grad_scale;
  bool nesterov, maximize, first_step;
};

// ---------------------------------------------------------------------------------------------------
// Widening and narrowing. bf16 -> fp32 is exact (the bits shifted up); fp32 -> bf16 rounds to nearest even
// and keeps NaN a (quiet) NaN, as c10::BFloat16's constructor does.

LIT_MULTIVERSION
void widen_bf16(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits_to_float(in[i]);
}

LIT_MULTIVERSION
void narrow_bf16(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16_bits(in[i]);
}

void widen_half(const c10::Half* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<float>(in[i]);
  }
}

void narrow_half(const float* in, c10::Half* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<c10::Half>(in[i]);
  }
}

// ---------------------------------------------------------------------------------------------------
// The update, torch.optim.SGD's arithmetic in fp32 (its order of operations; torch's own kernels may fuse a
// multiply and an add, so results agree to an ulp, not bit for bit).

LIT_MULTIVERSION
void sgd_update(float* param, float* grad, float* buf, int64_t n, const SgdOptions& o) {
  const float scale = o.grad_scale;
  const float sign = o.maximize ? -1.0f : 1.0f;
  const float wd = o.weight_decay;
  const float mom = o.momentum;
  const float keep = 1.0f - o.dampening;
  const float lr = o.lr;
  if (scale != 1.0f) {
    for (int64_t i = 0; i < n; ++i) grad[i] = grad[i] * scale;
  }
  if (o.maximize) {
    for (int64_t i = 0; i < n; ++i) grad[i] = sign * grad[i];
  }
  if (wd != 0.0f) {
    for (int64_t i = 0; i < n; ++i) grad[i] = grad[i] + param[i] * wd;
  }
  if (mom != 0.0f) {
    if (o.first_step) {
      for (int64_t i = 0; i < n; ++i) buf[i] = grad[i];
    } else {
      for (int64_t i = 0; i < n; ++i) buf[i] = buf[i] * mom + grad[i] * keep;
    }
    if (o.nesterov) {
      for (int64_t i = 0; i < n; ++i) grad[i] = grad[i] + buf[i] * mom;
    } else {
      for (int64_t i = 0; i < n; ++i) grad[i] = buf[i];
    }
  }
  for (int64_t i = 0; i < n; ++i) param[i] = param[i] - grad[i] * lr;
}

// ---------------------------------------------------------------------------------------------------
// Checks

bool dense(const at::Tensor& t) {
  return t.is_non_overlapping_and_dense();
}

// Same shape and the same order in memory: strides agree on every dimension of size > 1 (a 1x1 convolution's
// weight has different strides in NCHW and channels_last for the same bytes).
bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes()) {
    return false;
  }
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) {
      return false;
    }
  }
  return true;
}

void check_pair(const char* what, int64_t i, const at::Tensor& param, const at::Tensor& other) {
  TORCH_CHECK(
      same_layout(param, other) && dense(other),
      "master_sgd_step_: ", what, "[", i, "] must be dense with the shape and memory order of params[", i, "] (shape ",
      param.sizes(), ", strides ", param.strides(), "), got shape ", other.sizes(), ", strides ", other.strides());
  TORCH_CHECK(other.device() == param.device(), "master_sgd_step_: ", what, "[", i, "] is on ", other.device(),
              ", params[", i, "] on ", param.device());
}

void check_lists(
    const std::vector<at::Tensor>& params,
    const std::vector<at::Tensor>& grads,
    const std::vector<at::Tensor>& buffers,
    const std::vector<at::Tensor>& lows,
    double momentum) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n, "master_sgd_step_: ", n, " params but ", grads.size(), " grads");
  TORCH_CHECK(momentum == 0.0 || buffers.size() == n,
              "master_sgd_step_: momentum ", momentum, " needs one momentum buffer per param (", n, "), got ",
              buffers.size());
  TORCH_CHECK(lows.empty() || lows.size() == n,
              "master_sgd_step_: low_weights must be empty or one per param (", n, "), got ", lows.size());
  for (size_t k = 0; k < n; ++k) {
    const int64_t i = static_cast<int64_t>(k);
    const at::Tensor& p = params[k];
    TORCH_CHECK(p.scalar_type() == at::kFloat, "master_sgd_step_: params[", i, "] must be float32 (an fp32 master), got ",
                p.scalar_type());
    TORCH_CHECK(p.device().is_cpu(), "master_sgd_step_: the CPU kernel got params[", i, "] on ", p.device());
    TORCH_CHECK(dense(p), "master_sgd_step_: params[", i, "] must be dense (non-overlapping), got strides ",
                p.strides());
    const auto g = grads[k].scalar_type();
    TORCH_CHECK(g == at::kFloat || g == at::kBFloat16 || g == at::kHalf,
                "master_sgd_step_: grads[", i, "] must be float32, bfloat16 or float16, got ", g);
    check_pair("grads", i, p, grads[k]);
    if (momentum != 0.0) {
      TORCH_CHECK(buffers[k].scalar_type() == at::kFloat, "master_sgd_step_: momentum_buffers[", i,
                  "] must be float32, got ", buffers[k].scalar_type());
      check_pair("momentum_buffers", i, p, buffers[k]);
    }
    if (!lows.empty()) {
      const auto w = lows[k].scalar_type();
      TORCH_CHECK(w == at::kBFloat16 || w == at::kHalf, "master_sgd_step_: low_weights[", i,
                  "] must be bfloat16 or float16, got ", w);
      check_pair("low_weights", i, p, lows[k]);
    }
  }
}

// One parameter's elements [begin, end) in memory order.
void step_range(
    float* param,
    const at::Tensor& grad,
    float* buf,
    const at::Tensor& low,
    int64_t begin,
    int64_t end,
    const SgdOptions& o) {
  float g[kChunk];
  float scratch[kChunk];  // the momentum buffer when there is none (momentum 0)
  const auto grad_type = grad.scalar_type();
  for (int64_t start = begin; start < end; start += kChunk) {
    const int64_t n = std::min(kChunk, end - start);
    if (grad_type == at::kBFloat16) {
      widen_bf16(reinterpret_cast<const uint16_t*>(grad.const_data_ptr<c10::BFloat16>()) + start, g, n);
    } else if (grad_type == at::kHalf) {
      widen_half(grad.const_data_ptr<c10::Half>() + start, g, n);
    } else {
      std::memcpy(g, grad.const_data_ptr<float>() + start, n * sizeof(float));
    }
    sgd_update(param + start, g, buf != nullptr ? buf + start : scratch, n, o);
    if (!low.defined()) {
      continue;
    }
    if (low.scalar_type() == at::kBFloat16) {
      narrow_bf16(param + start, reinterpret_cast<uint16_t*>(low.mutable_data_ptr<c10::BFloat16>()) + start, n);
    } else {
      narrow_half(param + start, low.mutable_data_ptr<c10::Half>() + start, n);
    }
  }
}

void master_sgd_step_kernel(
    at::TensorList params,
    at::TensorList grads,
    at::TensorList momentum_buffers,
    at::TensorList low_weights,
    double lr,
    double momentum,
    double dampening,
    double weight_decay,
    bool nesterov,
    bool maximize,
    double grad_scale,
    bool first_step) {
  const std::vector<at::Tensor> ps = params.vec(), gs = grads.vec(), bs = momentum_buffers.vec(),
                                ws = low_weights.vec();
  check_lists(ps, gs, bs, ws, momentum);
  TORCH_CHECK(!nesterov || (momentum > 0.0 && dampening == 0.0),
              "master_sgd_step_: nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD)");
  const SgdOptions o{static_cast<float>(lr),         static_cast<float>(momentum),
                     static_cast<float>(dampening),  static_cast<float>(weight_decay),
                     static_cast<float>(grad_scale), nesterov,
                     maximize,                       first_step};
  for (size_t k = 0; k < ps.size(); ++k) {
    float* param = ps[k].mutable_data_ptr<float>();
    float* buf = momentum != 0.0 ? bs[k].mutable_data_ptr<float>() : nullptr;
    const at::Tensor& grad = gs[k];
    const at::Tensor low = ws.empty() ? at::Tensor() : ws[k];
    at::parallel_for(0, ps[k].numel(), kGrain, [&](int64_t begin, int64_t end) {
      step_range(param, grad, buf, low, begin, end, o);
    });
  }
}

// ---------------------------------------------------------------------------------------------------
// all_finite: one read of every tensor, no temporaries (torch.isfinite(t).all() writes a bool tensor per
// input). Exponent bits all ones means inf or NaN, for bf16, fp16 and fp32 alike.

LIT_MULTIVERSION bool finite16(const uint16_t* p, int64_t n, uint16_t mask) {
  uint16_t hit = 0;
  for (int64_t i = 0; i < n; ++i) {
    hit |= static_cast<uint16_t>((p[i] & mask) == mask);
  }
  return hit == 0;
}

LIT_MULTIVERSION bool finite64(const uint64_t* p, int64_t n) {
  uint64_t hit = 0;
  for (int64_t i = 0; i < n; ++i) {
    hit |= static_cast<uint64_t>((p[i] & 0x7FF0000000000000ull) == 0x7FF0000000000000ull);
  }
  return hit == 0;
}

LIT_MULTIVERSION bool finite32(const uint32_t* p, int64_t n) {
  uint32_t hit = 0;
  for (int64_t i = 0; i < n; ++i) {
    hit |= static_cast<uint32_t>((p[i] & 0x7F800000u) == 0x7F800000u);
  }
  return hit == 0;
}

bool tensors_finite(at::TensorList tensors) {
  for (size_t k = 0; k < tensors.size(); ++k) {
    const at::Tensor& t = tensors[k];
    TORCH_CHECK(t.device().is_cpu(), "all_finite: the CPU kernel got tensors[", k, "] on ", t.device());
    if (!t.is_floating_point()) {
      continue;  // integers are always finite
    }
    const auto type = t.scalar_type();
    TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf || type == at::kDouble,
                "all_finite: tensors[", k, "] has dtype ", type, "; float16, bfloat16, float32 or float64 expected");
    const at::Tensor c = dense(t) ? t : t.contiguous();
    const int64_t n = c.numel();
    std::atomic<bool> finite{true};
    at::parallel_for(0, n, 8 * kGrain, [&](int64_t begin, int64_t end) {
      bool ok = true;
      if (type == at::kBFloat16 || type == at::kHalf) {
        const uint16_t mask = type == at::kBFloat16 ? 0x7F80u : 0x7C00u;
        ok = finite16(static_cast<const uint16_t*>(c.const_data_ptr()) + begin, end - begin, mask);
      } else if (type == at::kFloat) {
        ok = finite32(static_cast<const uint32_t*>(c.const_data_ptr()) + begin, end - begin);
      } else {
        ok = finite64(static_cast<const uint64_t*>(c.const_data_ptr()) + begin, end - begin);
      }
      if (!ok) {
        finite.store(false, std::memory_order_relaxed);
      }
    });
    if (!finite.load()) {
      return false;
    }
  }
  return true;
}

at::Tensor all_finite_kernel(at::TensorList tensors) {
  return at::scalar_tensor(tensors_finite(tensors), at::TensorOptions().dtype(at::kBool));
}

}  // namespace

TORCH_LIBRARY_IMPL(lit_amp_det, CPU, m) {
  m.impl(TORCH_SELECTIVE_NAME("lit_amp_det::master_sgd_step_"), TORCH_FN(master_sgd_step_kernel));
  m.impl(TORCH_SELECTIVE_NAME("lit_amp_det::all_finite"), TORCH_FN(all_finite_kernel));
}

}  // namespace ops
}  // namespace lit_amp_det
