// CPU kernels of roi_align, multi_level_roi_align and their backwards (semantics: ../../README.md).
//
// roi_align is multi_level_roi_align with one level, so one templated implementation serves all four.
//
// * A SamplingPlan is built once per call, serially (K is small next to K * C * samples): per roi its
//   image, level and divisor, and per pooled row / column the *valid* bilinear taps along that axis,
//   offsets already multiplied by the strides of the tensor they will address. Bilinear RoIAlign is
//   separable: a sample is valid iff its y and its x are, and its 4 weights are products of one y and
//   one x weight, so ph * gh + pw * gw taps describe all ph * pw * gh * gw samples of a roi, and invalid
//   samples cost nothing later.
// * Planar (contiguous) features: a thread owns a range of rois and walks blocks of kChannelBlock
//   channels in its outer loop, so all of its rois sample the same few planes while they sit in cache
//   (rois overlap heavily) instead of streaming the whole feature map from memory once per roi.
// * channels_last features: the 4 corners of a sample are contiguous C-vectors, so the inner loop runs
//   over channels into an accumulator row, which the compiler vectorises. For bf16 / fp16 features (fp32
//   accumulators) that loop and the backward's scatter are compiled for AVX-512 and AVX2 as well
//   (multiversion.h); float32 and float64 keep the baseline build, and with it torchvision's exact sums.
// * Backward: threads own channel ranges, so no two of them ever write the same element. Planar: a block
//   of channels of every image and level is summed in a per-thread, channel-minor scratch (each corner
//   update is one short vector), then cast once into the output. channels_last: slices of C-vectors are
//   scattered into an accumulation-type buffer that is cast once at the end.
// Forward sums are written exactly as torchvision writes them, so float32 outputs match it bit for bit.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "bf16_bits.h"
#include "multiversion.h"

namespace lit_amp_det {
namespace ops {

namespace {

// Channels handled together by the planar kernels: each sample's taps and weights are formed once per block,
// the block's sums are independent dependency chains, and the backward scratch holds a block's accumulators
// per pixel as one 32-byte (float) vector. 8 measured fastest among 1/2/4/8/16 on the Mask R-CNN sizes.
constexpr int kChannelBlock = 8;

struct PoolParams {
  int64_t pooled_height;
  int64_t pooled_width;
  int64_t sampling_ratio;
  bool aligned;
};

// Extent of one level and the strides of the tensor the plan's offsets address (input or grad buffer).
struct LevelLayout {
  int64_t height;
  int64_t width;
  int64_t stride_h;
  int64_t stride_w;
};

// One sampling position along one axis: offsets of its two neighbouring rows (or columns) and their
// bilinear weights.
template <typename acc_t>
struct Tap {
  int64_t lo;
  int64_t hi;
  acc_t w_lo;
  acc_t w_hi;
};

template <typename acc_t>
struct RoiSamples {
  int64_t batch;
  int64_t level;
  acc_t count;  // divisor of every bin, max(grid_h * grid_w, 1) as in torchvision
  // y taps of bin row i: taps[bounds[y_bounds + i], bounds[y_bounds + i + 1]); likewise x.
  int64_t y_bounds;
  int64_t x_bounds;
};

template <typename acc_t>
struct SamplingPlan {
  std::vector<RoiSamples<acc_t>> rois;
  std::vector<Tap<acc_t>> taps;
  std::vector<int64_t> bounds;
};

// The taps of one bin (ty in y, tx in x) of one roi.
template <typename acc_t>
struct BinTaps {
  const Tap<acc_t>* y_begin;
  const Tap<acc_t>* y_end;
  const Tap<acc_t>* x_begin;
  const Tap<acc_t>* x_end;
};

template <typename acc_t>
BinTaps<acc_t> bin_taps(const SamplingPlan<acc_t>& plan, const RoiSamples<acc_t>& roi, int64_t i, int64_t j) {
  const Tap<acc_t>* taps = plan.taps.data();
  const int64_t* yb = plan.bounds.data() + roi.y_bounds;
  const int64_t* xb = plan.bounds.data() + roi.x_bounds;
  return {taps + yb[i], taps + yb[i + 1], taps + xb[j], taps + xb[j + 1]};
}

// ------------------------------------------------------------------------------------------------
// Input checks
// ------------------------------------------------------------------------------------------------

// `op` names the op in messages.
void check_pool_params(const char* op, int64_t pooled_height, int64_t pooled_width) {
  TORCH_CHECK(
      pooled_height > 0 && pooled_width > 0,
      op,
      ": pooled_height and pooled_width must be > 0, got ",
      pooled_height,
      " and ",
      pooled_width);
}

void check_rois(const char* op, const at::Tensor& rois) {
  TORCH_CHECK(rois.device().is_cpu(), op, ": rois must be a CPU tensor here, got ", rois.device());
  TORCH_CHECK(
      rois.dim() == 2 && rois.size(1) == 5,
      op,
      ": rois must be a [K, 5] tensor of (batch_index, x1, y1, x2, y2), got shape ",
      rois.sizes());
  TORCH_CHECK(at::isFloatingType(rois.scalar_type()), op, ": rois must be floating point, got ", rois.scalar_type());
}

void check_feature(const char* op, const at::Tensor& t, const std::string& name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor here, got ", t.device());
  TORCH_CHECK(t.dim() == 4, op, ": ", name, " must be a 4D [N, C, H, W] tensor, got ", t.dim(), "D");
  const auto dtype = t.scalar_type();
  TORCH_CHECK(
      dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kDouble,
      op,
      ": ",
      name,
      " must be float16, bfloat16, float32 or float64, got ",
      dtype);
}

void check_features(const char* op, at::TensorList features) {
  TORCH_CHECK(!features.empty(), op, ": features must hold at least one level, got none");
  check_feature(op, features[0], "features[0]");
  for (size_t l = 1; l < features.size(); ++l) {
    const at::Tensor& f = features[l];
    const std::string name = "features[" + std::to_string(l) + "]";
    check_feature(op, f, name);
    TORCH_CHECK(
        f.scalar_type() == features[0].scalar_type(),
        op,
        ": all levels must share one dtype, features[0] is ",
        features[0].scalar_type(),
        " but ",
        name,
        " is ",
        f.scalar_type());
    TORCH_CHECK(
        f.size(0) == features[0].size(0) && f.size(1) == features[0].size(1),
        op,
        ": all levels must share N and C, features[0] is ",
        features[0].sizes(),
        " but ",
        name,
        " is ",
        f.sizes());
  }
}

void check_levels(const char* op, const at::Tensor& levels, int64_t num_rois, size_t num_levels, size_t num_scales) {
  TORCH_CHECK(levels.device().is_cpu(), op, ": levels must be a CPU tensor here, got ", levels.device());
  TORCH_CHECK(levels.scalar_type() == at::kLong, op, ": levels must be int64, got ", levels.scalar_type());
  TORCH_CHECK(
      levels.dim() == 1 && levels.size(0) == num_rois,
      op,
      ": levels must be [K] with K = ",
      num_rois,
      " (one level per roi), got shape ",
      levels.sizes());
  TORCH_CHECK(
      num_scales == num_levels,
      op,
      ": got ",
      num_levels,
      " feature levels but ",
      num_scales,
      " spatial_scales; pass one scale per level");
}

void check_grad(const char* op, const at::Tensor& grad, int64_t num_rois, int64_t channels, const PoolParams& p) {
  check_feature(op, grad, "grad");
  TORCH_CHECK(
      grad.size(0) == num_rois && grad.size(1) == channels && grad.size(2) == p.pooled_height &&
          grad.size(3) == p.pooled_width,
      op,
      ": grad must be [K, C, pooled_height, pooled_width] = [",
      num_rois,
      ", ",
      channels,
      ", ",
      p.pooled_height,
      ", ",
      p.pooled_width,
      "], got ",
      grad.sizes());
}

// ------------------------------------------------------------------------------------------------
// Sampling plan
// ------------------------------------------------------------------------------------------------

// Samples per bin along one axis. A NaN or non-positive adaptive size gives no samples (torchvision's
// loops run zero times then); the cap only keeps the float -> int conversion defined for absurd rois.
template <typename acc_t>
int64_t grid_size(acc_t roi_size, int64_t pooled, int64_t sampling_ratio) {
  if (sampling_ratio > 0) {
    return sampling_ratio;
  }
  const acc_t grid = std::ceil(roi_size / static_cast<acc_t>(pooled));
  constexpr int64_t kMaxGrid = int64_t{1} << 30;
  if (!(grid > 0)) {
    return 0;
  }
  return grid < static_cast<acc_t>(kMaxGrid) ? static_cast<int64_t>(grid) : kMaxGrid;
}

// Appends the valid taps of `pooled` bins along one axis, closing each bin with its end in plan.bounds.
// Same arithmetic as torchvision: samples outside [-1, size] (or NaN) are dropped, the others clamped into
// the map and interpolated between their two neighbours (both the last row/column at the far edge).
template <typename acc_t>
void append_axis_taps(
    acc_t start,
    acc_t bin_size,
    int64_t pooled,
    int64_t grid,
    int64_t size,
    int64_t stride,
    SamplingPlan<acc_t>& plan) {
  for (int64_t p = 0; p < pooled; ++p) {
    for (int64_t s = 0; s < grid && size > 0; ++s) {
      acc_t pos = start + static_cast<acc_t>(p) * bin_size +
          static_cast<acc_t>(s + .5f) * bin_size / static_cast<acc_t>(grid);
      if (!(pos >= -1 && pos <= static_cast<acc_t>(size))) {
        continue;
      }
      pos = std::max(pos, acc_t(0));
      int64_t lo = static_cast<int64_t>(pos);
      int64_t hi = lo + 1;
      if (lo >= size - 1) {
        lo = hi = size - 1;
        pos = static_cast<acc_t>(lo);
      }
      const acc_t frac = pos - static_cast<acc_t>(lo);
      plan.taps.push_back({lo * stride, hi * stride, acc_t(1) - frac, frac});
    }
    plan.bounds.push_back(static_cast<int64_t>(plan.taps.size()));
  }
}

// Reads roi k and appends its taps. A roi that addresses no feature map -- a batch index (truncated toward
// zero, as torchvision does) outside [0, N), NaN included, or a level outside [0, L) -- gets no taps at all,
// so it pools to zeros and receives no gradient: the behaviour of every device (a GPU kernel cannot raise
// without a host sync), and the one padding rows with batch index -1 rely on.
template <typename acc_t>
void append_roi(
    const acc_t* box,
    int64_t level,
    c10::ArrayRef<double> spatial_scales,
    const std::vector<LevelLayout>& layouts,
    int64_t batch_size,
    const PoolParams& p,
    SamplingPlan<acc_t>& plan) {
  const bool addressable = level >= 0 && level < static_cast<int64_t>(layouts.size()) && box[0] > -1 &&
      box[0] < static_cast<acc_t>(batch_size);
  if (!addressable) {
    level = 0;
  }
  const acc_t scale = static_cast<acc_t>(spatial_scales[level]);
  const acc_t offset = p.aligned ? acc_t(0.5) : acc_t(0);
  const acc_t start_w = box[1] * scale - offset;
  const acc_t start_h = box[2] * scale - offset;
  acc_t roi_w = box[3] * scale - offset - start_w;
  acc_t roi_h = box[4] * scale - offset - start_h;
  if (!p.aligned) {  // legacy behaviour: malformed rois are forced to at least 1x1
    roi_w = std::max(roi_w, acc_t(1));
    roi_h = std::max(roi_h, acc_t(1));
  }
  const int64_t grid_h = grid_size(roi_h, p.pooled_height, p.sampling_ratio);
  const int64_t grid_w = grid_size(roi_w, p.pooled_width, p.sampling_ratio);
  const LevelLayout& layout = layouts[level];
  // a map of extent 0 yields no taps (see append_axis_taps)
  const int64_t height = addressable ? layout.height : 0;
  const int64_t width = addressable ? layout.width : 0;

  RoiSamples<acc_t> roi;
  roi.batch = addressable ? static_cast<int64_t>(box[0]) : 0;
  roi.level = level;
  roi.count = static_cast<acc_t>(std::max<int64_t>(grid_h * grid_w, 1));
  roi.y_bounds = static_cast<int64_t>(plan.bounds.size());
  plan.bounds.push_back(static_cast<int64_t>(plan.taps.size()));
  append_axis_taps(
      start_h, roi_h / static_cast<acc_t>(p.pooled_height), p.pooled_height, grid_h, height, layout.stride_h, plan);
  roi.x_bounds = static_cast<int64_t>(plan.bounds.size());
  plan.bounds.push_back(static_cast<int64_t>(plan.taps.size()));
  append_axis_taps(
      start_w, roi_w / static_cast<acc_t>(p.pooled_width), p.pooled_width, grid_w, width, layout.stride_w, plan);
  plan.rois.push_back(roi);
}

// rois: [K, 5] contiguous in acc_t; levels: K level indices, or nullptr for a single level.
template <typename acc_t>
SamplingPlan<acc_t> make_plan(
    const at::Tensor& rois,
    const int64_t* levels,
    c10::ArrayRef<double> spatial_scales,
    const std::vector<LevelLayout>& layouts,
    int64_t batch_size,
    const PoolParams& p) {
  const int64_t num_rois = rois.size(0);
  const acc_t* boxes = rois.const_data_ptr<acc_t>();
  SamplingPlan<acc_t> plan;
  plan.rois.reserve(num_rois);
  for (int64_t k = 0; k < num_rois; ++k) {
    append_roi(boxes + 5 * k, levels ? levels[k] : 0, spatial_scales, layouts, batch_size, p, plan);
  }
  return plan;
}

template <typename acc_t>
at::Tensor rois_in(const at::Tensor& rois) {
  return rois.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
}

// ------------------------------------------------------------------------------------------------
// Forward
// ------------------------------------------------------------------------------------------------

// Pools one roi over kBlock consecutive planar channel planes (plane + b * stride_c) into
// out[b * out_strides[0] + i * out_strides[1] + j * out_strides[2]]. Each tap's weights are formed once for
// the whole block, and the channels' sums are independent dependency chains that overlap in the CPU; per
// channel the expression and order are torchvision's, which keeps float32 results bit-identical to it.
template <int kBlock, typename scalar_t, typename acc_t>
void pool_planes(
    const scalar_t* plane,
    int64_t stride_c,
    const SamplingPlan<acc_t>& plan,
    const RoiSamples<acc_t>& roi,
    const PoolParams& p,
    scalar_t* out,
    const int64_t (&out_strides)[3]) {
  for (int64_t i = 0; i < p.pooled_height; ++i) {
    for (int64_t j = 0; j < p.pooled_width; ++j) {
      const BinTaps<acc_t> bin = bin_taps(plan, roi, i, j);
      acc_t sum[kBlock] = {};
      for (const Tap<acc_t>* ty = bin.y_begin; ty != bin.y_end; ++ty) {
        for (const Tap<acc_t>* tx = bin.x_begin; tx != bin.x_end; ++tx) {
          const acc_t w1 = ty->w_lo * tx->w_lo, w2 = ty->w_lo * tx->w_hi;
          const acc_t w3 = ty->w_hi * tx->w_lo, w4 = ty->w_hi * tx->w_hi;
          const scalar_t* p1 = plane + ty->lo + tx->lo;
          const scalar_t* p2 = plane + ty->lo + tx->hi;
          const scalar_t* p3 = plane + ty->hi + tx->lo;
          const scalar_t* p4 = plane + ty->hi + tx->hi;
          for (int b = 0; b < kBlock; ++b) {
            const int64_t o = b * stride_c;
            sum[b] += w1 * static_cast<acc_t>(p1[o]) + w2 * static_cast<acc_t>(p2[o]) +
                w3 * static_cast<acc_t>(p3[o]) + w4 * static_cast<acc_t>(p4[o]);
          }
        }
      }
      for (int b = 0; b < kBlock; ++b) {
        out[b * out_strides[0] + i * out_strides[1] + j * out_strides[2]] =
            static_cast<scalar_t>(sum[b] / roi.count);
      }
    }
  }
}

// True where the wide loops below serve a dtype: half-precision features summed in float.
template <typename scalar_t, typename acc_t>
constexpr bool kWideLoops = std::is_same_v<acc_t, float> && !std::is_same_v<scalar_t, float>;

// add_sample_row for contiguous bf16 C-vectors, compiled wide (LIT_MULTIVERSION): the same sum, which the wide
// clones may evaluate with fused multiply-adds.
LIT_MULTIVERSION
void add_sample_row_bf16(
    float* C10_RESTRICT acc,
    const uint16_t* p1,
    const uint16_t* p2,
    const uint16_t* p3,
    const uint16_t* p4,
    const float (&w)[4],
    int64_t channels) {
  for (int64_t c = 0; c < channels; ++c) {
    acc[c] += w[0] * bf16_bits_to_float(p1[c]) + w[1] * bf16_bits_to_float(p2[c]) +
        w[2] * bf16_bits_to_float(p3[c]) + w[3] * bf16_bits_to_float(p4[c]);
  }
}

// Adds one bilinear sample of a channels_last map to acc[0, channels): the 4 corners are C-vectors.
template <typename scalar_t, typename acc_t>
void add_sample_row(
    acc_t* C10_RESTRICT acc,
    const scalar_t* p1,
    const scalar_t* p2,
    const scalar_t* p3,
    const scalar_t* p4,
    const acc_t (&w)[4],
    int64_t channels,
    int64_t stride_c) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
    if (stride_c == 1) {
      add_sample_row_bf16(
          acc, reinterpret_cast<const uint16_t*>(p1), reinterpret_cast<const uint16_t*>(p2),
          reinterpret_cast<const uint16_t*>(p3), reinterpret_cast<const uint16_t*>(p4), w, channels);
      return;
    }
  }
  if (stride_c == 1) {  // the common case, kept separate so that the loop vectorises
    for (int64_t c = 0; c < channels; ++c) {
      acc[c] += w[0] * static_cast<acc_t>(p1[c]) + w[1] * static_cast<acc_t>(p2[c]) +
          w[2] * static_cast<acc_t>(p3[c]) + w[3] * static_cast<acc_t>(p4[c]);
    }
    return;
  }
  for (int64_t c = 0; c < channels; ++c) {
    const int64_t o = c * stride_c;
    acc[c] += w[0] * static_cast<acc_t>(p1[o]) + w[1] * static_cast<acc_t>(p2[o]) +
        w[2] * static_cast<acc_t>(p3[o]) + w[3] * static_cast<acc_t>(p4[o]);
  }
}

// Pools one roi over all channels of a channels_last image; acc is a scratch row of `channels`.
template <typename scalar_t, typename acc_t>
void pool_roi_channels_last(
    const scalar_t* image,
    int64_t channels,
    int64_t stride_c,
    const SamplingPlan<acc_t>& plan,
    const RoiSamples<acc_t>& roi,
    const PoolParams& p,
    acc_t* acc,
    scalar_t* out,
    const int64_t (&out_strides)[3]) {
  for (int64_t i = 0; i < p.pooled_height; ++i) {
    for (int64_t j = 0; j < p.pooled_width; ++j) {
      const BinTaps<acc_t> bin = bin_taps(plan, roi, i, j);
      std::fill(acc, acc + channels, acc_t(0));
      for (const Tap<acc_t>* ty = bin.y_begin; ty != bin.y_end; ++ty) {
        for (const Tap<acc_t>* tx = bin.x_begin; tx != bin.x_end; ++tx) {
          const acc_t w[4] = {
              ty->w_lo * tx->w_lo, ty->w_lo * tx->w_hi, ty->w_hi * tx->w_lo, ty->w_hi * tx->w_hi};
          add_sample_row(
              acc, image + ty->lo + tx->lo, image + ty->lo + tx->hi, image + ty->hi + tx->lo,
              image + ty->hi + tx->hi, w, channels, stride_c);
        }
      }
      scalar_t* o = out + i * out_strides[1] + j * out_strides[2];
      for (int64_t c = 0; c < channels; ++c) {
        o[c * out_strides[0]] = static_cast<scalar_t>(acc[c] / roi.count);
      }
    }
  }
}

template <typename scalar_t>
struct LevelData {
  const scalar_t* data;
  int64_t stride_n;
  int64_t stride_c;
};

template <typename scalar_t>
std::vector<LevelData<scalar_t>> level_data(at::TensorList features) {
  std::vector<LevelData<scalar_t>> out;
  for (const at::Tensor& f : features) {
    out.push_back({f.const_data_ptr<scalar_t>(), f.stride(0), f.stride(1)});
  }
  return out;
}

std::vector<LevelLayout> feature_layouts(at::TensorList features) {
  std::vector<LevelLayout> out;
  for (const at::Tensor& f : features) {
    out.push_back({f.size(2), f.size(3), f.stride(2), f.stride(3)});
  }
  return out;
}

// Rois are split across threads; channel blocks are the outer loop within a thread (see the file comment).
template <typename scalar_t, typename acc_t>
void forward_planar(
    const std::vector<LevelData<scalar_t>>& levels,
    int64_t channels,
    const SamplingPlan<acc_t>& plan,
    const PoolParams& p,
    at::Tensor& output) {
  scalar_t* out = output.mutable_data_ptr<scalar_t>();
  const int64_t so_k = output.stride(0), so_c = output.stride(1);
  const int64_t out_strides[3] = {so_c, output.stride(2), output.stride(3)};
  const int64_t num_rois = static_cast<int64_t>(plan.rois.size());
  at::parallel_for(0, num_rois, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = 0; c < channels; c += kChannelBlock) {
      const bool full = c + kChannelBlock <= channels;
      for (int64_t k = begin; k < end; ++k) {
        const RoiSamples<acc_t>& roi = plan.rois[k];
        const LevelData<scalar_t>& level = levels[roi.level];
        const scalar_t* plane = level.data + roi.batch * level.stride_n + c * level.stride_c;
        scalar_t* o = out + k * so_k + c * so_c;
        if (full) {
          pool_planes<kChannelBlock>(plane, level.stride_c, plan, roi, p, o, out_strides);
        } else {
          for (int64_t b = 0; c + b < channels; ++b) {  // the last, partial block
            pool_planes<1>(plane + b * level.stride_c, level.stride_c, plan, roi, p, o + b * so_c, out_strides);
          }
        }
      }
    }
  });
}

template <typename scalar_t, typename acc_t>
void forward_channels_last(
    const std::vector<LevelData<scalar_t>>& levels,
    int64_t channels,
    const SamplingPlan<acc_t>& plan,
    const PoolParams& p,
    at::Tensor& output) {
  scalar_t* out = output.mutable_data_ptr<scalar_t>();
  const int64_t so_k = output.stride(0);
  const int64_t out_strides[3] = {output.stride(1), output.stride(2), output.stride(3)};
  const int64_t num_rois = static_cast<int64_t>(plan.rois.size());
  at::parallel_for(0, num_rois, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc(channels);
    for (int64_t k = begin; k < end; ++k) {
      const RoiSamples<acc_t>& roi = plan.rois[k];
      const LevelData<scalar_t>& level = levels[roi.level];
      pool_roi_channels_last(
          level.data + roi.batch * level.stride_n, channels, level.stride_c, plan, roi, p, acc.data(),
          out + k * so_k, out_strides);
    }
  });
}

// features: checked; rois: checked, any float dtype; levels: K int64 values or nullptr (one level).
at::Tensor forward(
    at::TensorList features,
    const at::Tensor& rois,
    const int64_t* levels,
    c10::ArrayRef<double> spatial_scales,
    const PoolParams& p) {
  const at::Tensor& first = features[0];
  const at::MemoryFormat format = first.suggest_memory_format();
  const int64_t channels = first.size(1);
  at::Tensor output =
      at::empty({rois.size(0), channels, p.pooled_height, p.pooled_width}, first.options().memory_format(format));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, first.scalar_type(), "roi_align_forward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const SamplingPlan<acc_t> plan =
        make_plan<acc_t>(rois_in<acc_t>(rois), levels, spatial_scales, feature_layouts(features), first.size(0), p);
    if (output.numel() == 0) {
      return;
    }
    const auto data = level_data<scalar_t>(features);
    if (format == at::MemoryFormat::ChannelsLast) {
      forward_channels_last<scalar_t, acc_t>(data, channels, plan, p, output);
    } else {
      forward_planar<scalar_t, acc_t>(data, channels, plan, p, output);
    }
  });
  return output;
}

// ------------------------------------------------------------------------------------------------
// Backward
// ------------------------------------------------------------------------------------------------

// Shape, dtype and memory format of one level's gradient.
struct GradSpec {
  at::IntArrayRef sizes;  // [N, C, H, W]
  at::ScalarType dtype;
  at::MemoryFormat format;
};

// y[0, n) += a * x[0, n); separate calls per corner because corners coincide at the map's far edges.
template <typename acc_t>
void axpy(acc_t* C10_RESTRICT y, const acc_t* C10_RESTRICT x, acc_t a, int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    y[c] += a * x[c];
  }
}

// Adds g (n channel values of one output bin's gradient) times each of the bin's bilinear weights into the
// four corner pixels of every sample; image offsets come from the taps, channels are contiguous.
template <typename acc_t>
inline void scatter_bin(acc_t* image, const BinTaps<acc_t>& bin, const acc_t* g, int64_t n) {
  for (const Tap<acc_t>* ty = bin.y_begin; ty != bin.y_end; ++ty) {
    for (const Tap<acc_t>* tx = bin.x_begin; tx != bin.x_end; ++tx) {
      axpy(image + ty->lo + tx->lo, g, ty->w_lo * tx->w_lo, n);
      axpy(image + ty->lo + tx->hi, g, ty->w_lo * tx->w_hi, n);
      axpy(image + ty->hi + tx->lo, g, ty->w_hi * tx->w_lo, n);
      axpy(image + ty->hi + tx->hi, g, ty->w_hi * tx->w_hi, n);
    }
  }
}

// Scatters one roi's gradient for channels [c, c + num_channels) (grad points at grad[k, c, 0, 0],
// num_channels <= kChannelBlock) into a channel-minor scratch image: kChannelBlock accumulators per pixel, so
// each corner is one short vector update.
template <typename scalar_t, typename acc_t>
void scatter_block(
    acc_t* image,
    const scalar_t* grad,
    int64_t num_channels,
    const int64_t (&grad_strides)[3],
    const SamplingPlan<acc_t>& plan,
    const RoiSamples<acc_t>& roi,
    const PoolParams& p) {
  for (int64_t i = 0; i < p.pooled_height; ++i) {
    for (int64_t j = 0; j < p.pooled_width; ++j) {
      acc_t g[kChannelBlock] = {};  // a partial block's missing channels add zeros to unused slots
      const scalar_t* gij = grad + i * grad_strides[1] + j * grad_strides[2];
      for (int64_t b = 0; b < num_channels; ++b) {
        g[b] = static_cast<acc_t>(gij[b * grad_strides[0]]) / roi.count;
      }
      const BinTaps<acc_t> bin = bin_taps(plan, roi, i, j);
      scatter_bin(image, bin, g, kChannelBlock);
    }
  }
}

// Casts the first num_channels of a channel-minor H x W scratch image into out (pointing at out[n, c, 0, 0]),
// clearing the image for the next block while its rows are still in L1.
template <typename scalar_t, typename acc_t>
void store_block(
    acc_t* image,
    int64_t height,
    int64_t width,
    int64_t num_channels,
    scalar_t* out,
    const int64_t (&out_strides)[3]) {
  for (int64_t y = 0; y < height; ++y) {
    acc_t* row = image + y * width * kChannelBlock;
    for (int64_t b = 0; b < num_channels; ++b) {
      scalar_t* dst = out + b * out_strides[0] + y * out_strides[1];
      for (int64_t x = 0; x < width; ++x) {
        dst[x * out_strides[2]] = static_cast<scalar_t>(row[x * kChannelBlock + b]);
      }
    }
    std::fill(row, row + width * kChannelBlock, acc_t(0));
  }
}

// Planar backward: threads own blocks of kChannelBlock channels. Per block, every roi scatters into a
// per-thread channel-minor scratch holding that block of every image and level, then it is cast into the
// outputs.
template <typename scalar_t>
std::vector<at::Tensor> backward_planar(
    const at::Tensor& grad,
    const at::Tensor& rois,
    const int64_t* levels,
    c10::ArrayRef<double> spatial_scales,
    const std::vector<GradSpec>& specs,
    const PoolParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t batch_size = specs[0].sizes[0], channels = specs[0].sizes[1];
  std::vector<LevelLayout> layouts;
  std::vector<int64_t> level_offset;  // start of level l's N images in the scratch
  int64_t scratch_size = 0;
  std::vector<at::Tensor> outputs;
  for (const GradSpec& s : specs) {
    layouts.push_back({s.sizes[2], s.sizes[3], s.sizes[3] * kChannelBlock, kChannelBlock});
    level_offset.push_back(scratch_size);
    scratch_size += batch_size * s.sizes[2] * s.sizes[3] * kChannelBlock;
    outputs.push_back(at::empty(s.sizes, grad.options().dtype(s.dtype).memory_format(s.format)));
  }
  const SamplingPlan<acc_t> plan =
      make_plan<acc_t>(rois_in<acc_t>(rois), levels, spatial_scales, layouts, batch_size, p);
  const scalar_t* g = grad.const_data_ptr<scalar_t>();
  const int64_t sg_k = grad.stride(0);
  const int64_t grad_strides[3] = {grad.stride(1), grad.stride(2), grad.stride(3)};
  std::vector<scalar_t*> out_data;
  for (at::Tensor& out : outputs) {
    out_data.push_back(out.mutable_data_ptr<scalar_t>());
  }

  const int64_t num_blocks = (channels + kChannelBlock - 1) / kChannelBlock;
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> scratch(scratch_size, acc_t(0));  // store_block clears it after each block
    for (int64_t block = begin; block < end; ++block) {
      const int64_t c = block * kChannelBlock;
      const int64_t num_channels = std::min<int64_t>(kChannelBlock, channels - c);
      for (size_t k = 0; k < plan.rois.size(); ++k) {
        const RoiSamples<acc_t>& roi = plan.rois[k];
        const LevelLayout& l = layouts[roi.level];
        acc_t* image =
            scratch.data() + level_offset[roi.level] + roi.batch * l.height * l.width * kChannelBlock;
        scatter_block(image, g + k * sg_k + c * grad_strides[0], num_channels, grad_strides, plan, roi, p);
      }
      for (size_t level = 0; level < specs.size(); ++level) {
        const at::Tensor& out = outputs[level];
        const LevelLayout& l = layouts[level];
        const int64_t out_strides[3] = {out.stride(1), out.stride(2), out.stride(3)};
        for (int64_t b = 0; b < batch_size; ++b) {
          store_block(
              scratch.data() + level_offset[level] + b * l.height * l.width * kChannelBlock, l.height, l.width,
              num_channels,
              out_data[level] + b * out.stride(0) + c * out.stride(1), out_strides);
        }
      }
    }
  });
  return outputs;
}

// Adds one roi's bins of n gradients (g_bins: ph * pw rows of n, already divided by the roi's count) into a
// channels_last accumulation buffer (image points at the first of those channels in the roi's image), bin by bin.
template <typename acc_t>
inline void scatter_roi_bins(
    acc_t* image,
    const SamplingPlan<acc_t>& plan,
    const RoiSamples<acc_t>& roi,
    const PoolParams& p,
    const acc_t* g_bins,
    int64_t n) {
  for (int64_t i = 0; i < p.pooled_height; ++i) {
    for (int64_t j = 0; j < p.pooled_width; ++j) {
      scatter_bin(image, bin_taps(plan, roi, i, j), g_bins + (i * p.pooled_width + j) * n, n);
    }
  }
}

// scatter_roi_bins for half-precision gradients (float accumulators), compiled wide (LIT_MULTIVERSION). One call
// per roi lets the clones inline their vector axpys; a call per corner update through the clone dispatch cost
// more than the updates themselves.
LIT_MULTIVERSION
void scatter_roi_bins_wide(
    float* image,
    const SamplingPlan<float>& plan,
    const RoiSamples<float>& roi,
    const PoolParams& p,
    const float* g_bins,
    int64_t n) {
  scatter_roi_bins(image, plan, roi, p, g_bins, n);
}

// Scatters one roi's gradient for channels [c0, c0 + n) (grad points at grad[k, c0, 0, 0]) into a channels_last
// accumulation buffer: gathers its bins into g_bins (ph * pw * n), then adds them bin by bin, in the order
// torchvision adds them (float32 and float64 sums match it).
template <typename scalar_t, typename acc_t>
void scatter_roi_channels_last(
    acc_t* image,
    const scalar_t* grad,
    const int64_t (&grad_strides)[3],
    int64_t n,
    const SamplingPlan<acc_t>& plan,
    const RoiSamples<acc_t>& roi,
    const PoolParams& p,
    acc_t* g_bins) {
  acc_t* dst = g_bins;
  for (int64_t i = 0; i < p.pooled_height; ++i) {
    for (int64_t j = 0; j < p.pooled_width; ++j, dst += n) {
      const scalar_t* g = grad + i * grad_strides[1] + j * grad_strides[2];
      for (int64_t c = 0; c < n; ++c) {
        dst[c] = static_cast<acc_t>(g[c * grad_strides[0]]) / roi.count;
      }
    }
  }
  if constexpr (kWideLoops<scalar_t, acc_t>) {
    scatter_roi_bins_wide(image, plan, roi, p, g_bins, n);
  } else {
    scatter_roi_bins(image, plan, roi, p, g_bins, n);
  }
}

// channels_last backward: each thread owns a channel range of a channels_last accumulation buffer per
// level; the buffers are cast once at the end (a no-op for float32 / float64 channels_last outputs).
template <typename scalar_t>
std::vector<at::Tensor> backward_channels_last(
    const at::Tensor& grad,
    const at::Tensor& rois,
    const int64_t* levels,
    c10::ArrayRef<double> spatial_scales,
    const std::vector<GradSpec>& specs,
    const PoolParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t batch_size = specs[0].sizes[0], channels = specs[0].sizes[1];
  const auto acc_options = grad.options()
                               .dtype(c10::CppTypeToScalarType<acc_t>::value)
                               .memory_format(at::MemoryFormat::ChannelsLast);
  std::vector<at::Tensor> buffers;
  std::vector<acc_t*> images;  // image 0 of each level's buffer
  std::vector<int64_t> image_strides;
  std::vector<LevelLayout> layouts;
  for (const GradSpec& s : specs) {
    buffers.push_back(at::empty(s.sizes, acc_options).zero_());  // at::zeros would drop the memory format
    images.push_back(buffers.back().mutable_data_ptr<acc_t>());
    image_strides.push_back(buffers.back().stride(0));
    layouts.push_back({s.sizes[2], s.sizes[3], buffers.back().stride(2), buffers.back().stride(3)});
  }

  const SamplingPlan<acc_t> plan =
      make_plan<acc_t>(rois_in<acc_t>(rois), levels, spatial_scales, layouts, batch_size, p);
  const scalar_t* g = grad.const_data_ptr<scalar_t>();
  const int64_t sg_k = grad.stride(0);
  const int64_t grad_strides[3] = {grad.stride(1), grad.stride(2), grad.stride(3)};

  // Channel ranges of a few cache lines keep the inner loops long enough to vectorise.
  constexpr int64_t kChannelGrain = 32;
  at::parallel_for(0, channels, kChannelGrain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> g_bins(p.pooled_height * p.pooled_width * (end - begin));
    for (size_t k = 0; k < plan.rois.size(); ++k) {
      const RoiSamples<acc_t>& roi = plan.rois[k];
      acc_t* image = images[roi.level] + roi.batch * image_strides[roi.level] + begin;
      scatter_roi_channels_last(
          image, g + k * sg_k + begin * grad_strides[0], grad_strides, end - begin, plan, roi, p, g_bins.data());
    }
  });

  std::vector<at::Tensor> outputs;
  for (size_t l = 0; l < specs.size(); ++l) {
    outputs.push_back(buffers[l].to(specs[l].dtype, /*non_blocking=*/false, /*copy=*/false, specs[l].format));
  }
  return outputs;
}

// grad: checked [K, C, ph, pw]; specs: one per level, all with grad's dtype; the buffer layout follows
// `compute_format` (that of the forward output, hence of grad in practice).
std::vector<at::Tensor> backward(
    const at::Tensor& grad,
    const at::Tensor& rois,
    const int64_t* levels,
    c10::ArrayRef<double> spatial_scales,
    const std::vector<GradSpec>& specs,
    at::MemoryFormat compute_format,
    const PoolParams& p) {
  std::vector<at::Tensor> outputs;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "roi_align_backward_cpu", [&] {
    outputs = compute_format == at::MemoryFormat::ChannelsLast
        ? backward_channels_last<scalar_t>(grad, rois, levels, spatial_scales, specs, p)
        : backward_planar<scalar_t>(grad, rois, levels, spatial_scales, specs, p);
  });
  return outputs;
}

// ------------------------------------------------------------------------------------------------
// Op entry points
// ------------------------------------------------------------------------------------------------

at::Tensor roi_align_forward_kernel(
    const at::Tensor& input,
    const at::Tensor& rois,
    double spatial_scale,
    int64_t pooled_height,
    int64_t pooled_width,
    int64_t sampling_ratio,
    bool aligned) {
  constexpr const char* op = "roi_align";
  check_feature(op, input, "input");
  check_rois(op, rois);
  check_pool_params(op, pooled_height, pooled_width);
  const double scales[1] = {spatial_scale};
  return forward(input, rois, nullptr, scales, {pooled_height, pooled_width, sampling_ratio, aligned});
}

at::Tensor roi_align_backward_kernel(
    const at::Tensor& grad,
    const at::Tensor& rois,
    double spatial_scale,
    int64_t pooled_height,
    int64_t pooled_width,
    int64_t batch_size,
    int64_t channels,
    int64_t height,
    int64_t width,
    int64_t sampling_ratio,
    bool aligned) {
  constexpr const char* op = "_roi_align_backward";
  check_rois(op, rois);
  check_pool_params(op, pooled_height, pooled_width);
  TORCH_CHECK(
      batch_size >= 0 && channels >= 0 && height >= 0 && width >= 0,
      op,
      ": input sizes must be >= 0, got [",
      batch_size,
      ", ",
      channels,
      ", ",
      height,
      ", ",
      width,
      "]");
  const PoolParams p{pooled_height, pooled_width, sampling_ratio, aligned};
  check_grad(op, grad, rois.size(0), channels, p);
  const std::vector<int64_t> sizes = {batch_size, channels, height, width};
  const at::MemoryFormat format = grad.suggest_memory_format();
  const double scales[1] = {spatial_scale};
  return backward(grad, rois, nullptr, scales, {{sizes, grad.scalar_type(), format}}, format, p)[0];
}

// The checks both multi-level entry points share.
void check_multi_level_inputs(
    const char* op,
    at::TensorList features,
    const at::Tensor& rois,
    const at::Tensor& levels,
    at::ArrayRef<double> spatial_scales,
    int64_t pooled_height,
    int64_t pooled_width) {
  check_features(op, features);
  check_rois(op, rois);
  check_levels(op, levels, rois.size(0), features.size(), spatial_scales.size());
  check_pool_params(op, pooled_height, pooled_width);
}

at::Tensor multi_level_roi_align_forward_kernel(
    at::TensorList features,
    const at::Tensor& rois,
    const at::Tensor& levels,
    at::ArrayRef<double> spatial_scales,
    int64_t pooled_height,
    int64_t pooled_width,
    int64_t sampling_ratio,
    bool aligned) {
  constexpr const char* op = "multi_level_roi_align";
  check_multi_level_inputs(op, features, rois, levels, spatial_scales, pooled_height, pooled_width);
  const at::Tensor levels_ = levels.contiguous();
  return forward(
      features, rois, levels_.const_data_ptr<int64_t>(), spatial_scales,
      {pooled_height, pooled_width, sampling_ratio, aligned});
}

std::vector<at::Tensor> multi_level_roi_align_backward_kernel(
    const at::Tensor& grad,
    at::TensorList features,
    const at::Tensor& rois,
    const at::Tensor& levels,
    at::ArrayRef<double> spatial_scales,
    int64_t pooled_height,
    int64_t pooled_width,
    int64_t sampling_ratio,
    bool aligned) {
  constexpr const char* op = "_multi_level_roi_align_backward";
  check_multi_level_inputs(op, features, rois, levels, spatial_scales, pooled_height, pooled_width);
  const PoolParams p{pooled_height, pooled_width, sampling_ratio, aligned};
  check_grad(op, grad, rois.size(0), features[0].size(1), p);
  TORCH_CHECK(
      grad.scalar_type() == features[0].scalar_type(),
      op,
      ": grad must have the features' dtype ",
      features[0].scalar_type(),
      ", got ",
      grad.scalar_type());
  std::vector<GradSpec> specs;
  for (const at::Tensor& f : features) {
    specs.push_back({f.sizes(), f.scalar_type(), f.suggest_memory_format()});
  }
  const at::Tensor levels_ = levels.contiguous();
  return backward(
      grad, rois, levels_.const_data_ptr<int64_t>(), spatial_scales, specs, features[0].suggest_memory_format(), p);
}

} // namespace

TORCH_LIBRARY_IMPL(lit_amp_det, CPU, m) {
  m.impl("roi_align", TORCH_FN(roi_align_forward_kernel));
  m.impl("_roi_align_backward", TORCH_FN(roi_align_backward_kernel));
  m.impl("multi_level_roi_align", TORCH_FN(multi_level_roi_align_forward_kernel));
  m.impl("_multi_level_roi_align_backward", TORCH_FN(multi_level_roi_align_backward_kernel));
}

} // namespace ops
} // namespace lit_amp_det
