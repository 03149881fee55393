// CUDA kernels of lit_amp_det::roi_align, multi_level_roi_align and their backwards
// (semantics: csrc/README.md, torchvision's RoIAlign).
//
// One templated implementation serves both ops: roi_align is multi_level_roi_align with one level and
// no level tensor. The feature levels travel by value in a LevelTable kernel argument (up to
// kMaxLevels), so every roi reads its own level's pointer, size, strides and scale without a
// zeros-then-scatter pass per level.
//
// Forward: one thread per output element (k, c, ph, pw). Features are read through their strides
// (contiguous or channels_last, no copy); for a channels_last input the thread index runs over
// channels fastest, so a warp reads consecutive channels of one [n, y, x, :] pixel and writes a
// channels_last output row. Coordinates, weights and sums are in acc_t (float for fp16/bf16/fp32,
// double for fp64); RoIs are converted to acc_t once on the host.
// Backward: one thread per grad element, atomic adds into an acc_t buffer per level (in the memory
// format of the gradient that will be returned), cast once to the gradient dtype at the end.
#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/Atomic.cuh>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "exact_math.cuh"

#include <limits>
#include <vector>

namespace {

using namespace lit_amp_det::ops::cuda_math;  // NOLINT: exact add/sub/mul/div, box IoU

constexpr int kThreads = 256;
constexpr int kMaxLevels = 8;

// One feature level as a kernel sees it. ptr_t is `const scalar_t*` (features, forward) or
// `acc_t*` (gradient buffer, backward); strides are in elements.
template <typename ptr_t, typename acc_t>
struct Level {
  ptr_t data;
  int height;
  int width;
  int64_t stride_n;
  int64_t stride_c;
  int64_t stride_h;
  int64_t stride_w;
  acc_t spatial_scale;
};

template <typename ptr_t, typename acc_t>
struct LevelTable {
  Level<ptr_t, acc_t> level[kMaxLevels];
  int num_levels;
  int64_t batch_size;  // N, the same for every level
};

// Position of one pooled element: roi k, channel c, bin (ph, pw).
struct BinIndex {
  int64_t k;
  int64_t c;
  int ph;
  int pw;
};

// Decomposes a flat thread index; channels run fastest for channels_last ([K, ph, pw, C] order),
// pw fastest otherwise ([K, C, ph, pw] order).
template <bool kChannelsLast>
__device__ __forceinline__ BinIndex decompose(int64_t index, int64_t channels, int pooled_h,
                                              int pooled_w) {
  BinIndex at;
  if (kChannelsLast) {
    at.c = index % channels;
    index /= channels;
    at.pw = static_cast<int>(index % pooled_w);
    index /= pooled_w;
    at.ph = static_cast<int>(index % pooled_h);
    at.k = index / pooled_h;
  } else {
    at.pw = static_cast<int>(index % pooled_w);
    index /= pooled_w;
    at.ph = static_cast<int>(index % pooled_h);
    index /= pooled_h;
    at.c = index % channels;
    at.k = index / channels;
  }
  return at;
}

// The level and image a roi pools from; false when either is out of range or the level map is empty,
// and the roi then pools zeros and gets no gradient (checking on the host would cost a device sync).
// The image index truncates toward zero like torchvision's int cast: valid iff -1 < b < N.
template <typename ptr_t, typename acc_t>
__device__ __forceinline__ bool resolve_roi(const LevelTable<ptr_t, acc_t>& table, const acc_t* roi,
                                            const int64_t* roi_levels, int64_t k, int& level,
                                            int64_t& image) {
  const int64_t l = roi_levels != nullptr ? roi_levels[k] : 0;
  if (l < 0 || l >= table.num_levels) {
    return false;
  }
  const acc_t b = roi[0];
  if (!(b > acc_t(-1) && b < static_cast<acc_t>(table.batch_size))) {  // NaN fails too
    return false;
  }
  level = static_cast<int>(l);
  image = static_cast<int64_t>(b);
  return table.level[level].height > 0 && table.level[level].width > 0;
}

// Sampling grid of one roi in feature coordinates (torchvision's roi_align_forward_kernel_impl).
template <typename acc_t>
struct RoiGrid {
  acc_t start_h;
  acc_t start_w;
  acc_t bin_h;
  acc_t bin_w;
  int grid_h;  // samples per bin along y; 0 for an empty (or NaN) aligned roi
  int grid_w;
  acc_t count;  // divisor of the bin sum: max(grid_h * grid_w, 1)
};

// Samples per bin along one axis: sampling_ratio, or ceil(roi_size / pooled_size) = ceil(bin_size).
// A non-positive or NaN adaptive size gives none (torchvision's loops then run zero times, and the
// divisor is 1); the cap only keeps the float -> int conversion defined for absurd rois.
template <typename acc_t>
__device__ __forceinline__ int grid_size(acc_t bin_size, int sampling_ratio) {
  if (sampling_ratio > 0) {
    return sampling_ratio;
  }
  constexpr int kMaxGrid = 1 << 30;
  const acc_t grid = ceil(bin_size);
  if (!(grid > acc_t(0))) {
    return 0;
  }
  return grid < static_cast<acc_t>(kMaxGrid) ? static_cast<int>(grid) : kMaxGrid;
}

template <typename acc_t>
__device__ __forceinline__ RoiGrid<acc_t> roi_grid(const acc_t* roi, acc_t spatial_scale,
                                                   int pooled_h, int pooled_w, int sampling_ratio,
                                                   bool aligned) {
  const acc_t offset = aligned ? acc_t(0.5) : acc_t(0);
  RoiGrid<acc_t> g;
  g.start_w = sub_rn(mul_rn(roi[1], spatial_scale), offset);
  g.start_h = sub_rn(mul_rn(roi[2], spatial_scale), offset);
  const acc_t end_w = sub_rn(mul_rn(roi[3], spatial_scale), offset);
  const acc_t end_h = sub_rn(mul_rn(roi[4], spatial_scale), offset);
  acc_t roi_w = sub_rn(end_w, g.start_w);
  acc_t roi_h = sub_rn(end_h, g.start_h);
  if (!aligned) {  // legacy mode: force malformed rois to be 1x1
    roi_w = roi_w < acc_t(1) ? acc_t(1) : roi_w;
    roi_h = roi_h < acc_t(1) ? acc_t(1) : roi_h;
  }
  g.bin_h = div_rn(roi_h, static_cast<acc_t>(pooled_h));
  g.bin_w = div_rn(roi_w, static_cast<acc_t>(pooled_w));
  g.grid_h = grid_size(g.bin_h, sampling_ratio);
  g.grid_w = grid_size(g.bin_w, sampling_ratio);
  const int64_t count = static_cast<int64_t>(g.grid_h) * g.grid_w;
  g.count = static_cast<acc_t>(count > 1 ? count : 1);
  return g;
}

// Coordinate of sample `sample` of bin `bin`: start + bin * bin_size + (sample + .5) * bin_size / grid,
// evaluated in that order as torchvision does.
template <typename acc_t>
__device__ __forceinline__ acc_t sample_coord(acc_t start, int bin, acc_t bin_size, int sample,
                                              int grid) {
  const acc_t bin_start = add_rn(start, mul_rn(static_cast<acc_t>(bin), bin_size));
  const acc_t within = div_rn(mul_rn(static_cast<acc_t>(sample) + acc_t(0.5), bin_size),
                              static_cast<acc_t>(grid));
  return add_rn(bin_start, within);
}

// The four bilinear taps of point (y, x) in an H x W plane: element offsets and weights.
template <typename acc_t>
struct Taps {
  int64_t offset[4];
  acc_t weight[4];
};

// false: (y, x) lies outside [-1, H] x [-1, W] (or is NaN) and contributes nothing. Needs H, W >= 1.
template <typename acc_t>
__device__ __forceinline__ bool bilinear_taps(int height, int width, int64_t stride_h,
                                              int64_t stride_w, acc_t y, acc_t x, Taps<acc_t>& taps) {
  if (!(y >= acc_t(-1) && y <= static_cast<acc_t>(height) && x >= acc_t(-1) &&
        x <= static_cast<acc_t>(width))) {
    return false;
  }
  if (y <= acc_t(0)) {
    y = 0;
  }
  if (x <= acc_t(0)) {
    x = 0;
  }
  int y_low = static_cast<int>(y);
  int x_low = static_cast<int>(x);
  int y_high;
  int x_high;
  if (y_low >= height - 1) {
    y_high = y_low = height - 1;
    y = static_cast<acc_t>(y_low);
  } else {
    y_high = y_low + 1;
  }
  if (x_low >= width - 1) {
    x_high = x_low = width - 1;
    x = static_cast<acc_t>(x_low);
  } else {
    x_high = x_low + 1;
  }
  const acc_t ly = y - static_cast<acc_t>(y_low);
  const acc_t lx = x - static_cast<acc_t>(x_low);
  const acc_t hy = acc_t(1) - ly;
  const acc_t hx = acc_t(1) - lx;
  taps.weight[0] = hy * hx;
  taps.weight[1] = hy * lx;
  taps.weight[2] = ly * hx;
  taps.weight[3] = ly * lx;
  taps.offset[0] = y_low * stride_h + x_low * stride_w;
  taps.offset[1] = y_low * stride_h + x_high * stride_w;
  taps.offset[2] = y_high * stride_h + x_low * stride_w;
  taps.offset[3] = y_high * stride_h + x_high * stride_w;
  return true;
}

// One thread per output element; `out` is written through its strides, and the thread order matches
// its memory format (kChannelsLast), so the writes are coalesced.
template <typename scalar_t, typename acc_t, bool kChannelsLast>
__global__ void __launch_bounds__(kThreads) roi_align_forward_kernel(
    int64_t total,
    const __grid_constant__ LevelTable<const scalar_t*, acc_t> table,
    const acc_t* __restrict__ rois,          // [K, 5]
    const int64_t* __restrict__ roi_levels,  // [K], or nullptr: every roi on level 0
    int64_t channels, int pooled_h, int pooled_w, int sampling_ratio, bool aligned,
    scalar_t* __restrict__ out, int64_t out_stride_k, int64_t out_stride_c, int64_t out_stride_h,
    int64_t out_stride_w) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= total) {
    return;
  }
  const BinIndex at = decompose<kChannelsLast>(index, channels, pooled_h, pooled_w);
  const acc_t* roi = rois + at.k * 5;
  acc_t value = 0;
  int level;
  int64_t image;
  if (resolve_roi(table, roi, roi_levels, at.k, level, image)) {
    const Level<const scalar_t*, acc_t>& map = table.level[level];
    const RoiGrid<acc_t> g =
        roi_grid(roi, map.spatial_scale, pooled_h, pooled_w, sampling_ratio, aligned);
    const scalar_t* plane = map.data + image * map.stride_n + at.c * map.stride_c;
    acc_t sum = 0;
    for (int iy = 0; iy < g.grid_h; ++iy) {
      const acc_t y = sample_coord(g.start_h, at.ph, g.bin_h, iy, g.grid_h);
      for (int ix = 0; ix < g.grid_w; ++ix) {
        const acc_t x = sample_coord(g.start_w, at.pw, g.bin_w, ix, g.grid_w);
        Taps<acc_t> taps;
        if (bilinear_taps(map.height, map.width, map.stride_h, map.stride_w, y, x, taps)) {
          sum += taps.weight[0] * static_cast<acc_t>(plane[taps.offset[0]]) +
                 taps.weight[1] * static_cast<acc_t>(plane[taps.offset[1]]) +
                 taps.weight[2] * static_cast<acc_t>(plane[taps.offset[2]]) +
                 taps.weight[3] * static_cast<acc_t>(plane[taps.offset[3]]);
        }
      }
    }
    value = sum / g.count;
  }
  out[at.k * out_stride_k + at.c * out_stride_c + at.ph * out_stride_h + at.pw * out_stride_w] =
      static_cast<scalar_t>(value);
}

// One thread per element of grad (read through its strides, in the order of its memory format);
// each sample scatters grad * weight / count into the acc_t buffer of the roi's level.
template <typename scalar_t, typename acc_t, bool kChannelsLast>
__global__ void __launch_bounds__(kThreads) roi_align_backward_kernel(
    int64_t total,
    const scalar_t* __restrict__ grad,  // [K, C, ph, pw]
    int64_t grad_stride_k, int64_t grad_stride_c, int64_t grad_stride_h, int64_t grad_stride_w,
    const __grid_constant__ LevelTable<acc_t*, acc_t> table,
    const acc_t* __restrict__ rois,          // [K, 5]
    const int64_t* __restrict__ roi_levels,  // [K], or nullptr: every roi on level 0
    int64_t channels, int pooled_h, int pooled_w, int sampling_ratio, bool aligned) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= total) {
    return;
  }
  const BinIndex at = decompose<kChannelsLast>(index, channels, pooled_h, pooled_w);
  const acc_t* roi = rois + at.k * 5;
  int level;
  int64_t image;
  if (!resolve_roi(table, roi, roi_levels, at.k, level, image)) {
    return;
  }
  const Level<acc_t*, acc_t>& map = table.level[level];
  const RoiGrid<acc_t> g =
      roi_grid(roi, map.spatial_scale, pooled_h, pooled_w, sampling_ratio, aligned);
  const acc_t grad_bin = static_cast<acc_t>(grad[at.k * grad_stride_k + at.c * grad_stride_c +
                                                 at.ph * grad_stride_h + at.pw * grad_stride_w]);
  acc_t* plane = map.data + image * map.stride_n + at.c * map.stride_c;
  for (int iy = 0; iy < g.grid_h; ++iy) {
    const acc_t y = sample_coord(g.start_h, at.ph, g.bin_h, iy, g.grid_h);
    for (int ix = 0; ix < g.grid_w; ++ix) {
      const acc_t x = sample_coord(g.start_w, at.pw, g.bin_w, ix, g.grid_w);
      Taps<acc_t> taps;
      if (bilinear_taps(map.height, map.width, map.stride_h, map.stride_w, y, x, taps)) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          gpuAtomicAdd(plane + taps.offset[q], grad_bin * taps.weight[q] / g.count);
        }
      }
    }
  }
}

// Host side -------------------------------------------------------------------------------------

bool is_supported_float(at::ScalarType type) {
  return type == at::kHalf || type == at::kBFloat16 || type == at::kFloat || type == at::kDouble;
}

// Per-map checks shared by every entry point; `name` is how the caller knows the tensor.
void check_feature_map(const at::Tensor& map, const std::string& name) {
  TORCH_CHECK(map.is_cuda(), name, " should be a CUDA tensor, got one on ", map.device());
  TORCH_CHECK(map.dim() == 4, name, " should be a 4d tensor [N, C, H, W], got ", map.dim(), "D");
  TORCH_CHECK(is_supported_float(map.scalar_type()), name,
              " should be float16, bfloat16, float32 or float64, got ", map.scalar_type());
  TORCH_CHECK(map.size(2) <= std::numeric_limits<int>::max() &&
                  map.size(3) <= std::numeric_limits<int>::max(),
              name, " has a spatial size beyond 2^31 - 1: ", map.sizes());
}

void check_rois(const at::Tensor& rois, const at::Device& device) {
  TORCH_CHECK(rois.device() == device, "rois should be on the same device as the features (", device,
              "), got ", rois.device());
  TORCH_CHECK(rois.dim() == 2 && rois.size(1) == 5,
              "rois should have shape [K, 5] (batch_index, x1, y1, x2, y2), got ", rois.sizes());
  TORCH_CHECK(is_supported_float(rois.scalar_type()),
              "rois should be float16, bfloat16, float32 or float64, got ", rois.scalar_type());
}

void check_pooling(int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio) {
  TORCH_CHECK(pooled_height > 0 && pooled_width > 0,
              "pooled_height and pooled_width should be positive, got ", pooled_height, " and ",
              pooled_width);
  TORCH_CHECK(pooled_height <= std::numeric_limits<int>::max() &&
                  pooled_width <= std::numeric_limits<int>::max() &&
                  sampling_ratio <= std::numeric_limits<int>::max(),
              "pooled size (", pooled_height, ", ", pooled_width, ") and sampling_ratio (",
              sampling_ratio, ") should fit in 32 bits");
}

// features: 1 to kMaxLevels maps agreeing in device, dtype, N and C; levels and scales match them.
void check_levels(at::TensorList features, const at::Tensor& rois, const at::Tensor& levels,
                  at::ArrayRef<double> spatial_scales) {
  TORCH_CHECK(!features.empty() && features.size() <= static_cast<size_t>(kMaxLevels),
              "features should hold 1 to ", kMaxLevels, " feature levels, got ", features.size());
  const at::Tensor& first = features[0];
  for (size_t l = 0; l < features.size(); ++l) {
    const at::Tensor& map = features[l];
    const std::string name = "features[" + std::to_string(l) + "]";
    check_feature_map(map, name);
    TORCH_CHECK(map.device() == first.device(), name, " should be on ", first.device(),
                " like features[0], got ", map.device());
    TORCH_CHECK(map.scalar_type() == first.scalar_type(), name, " should have dtype ",
                first.scalar_type(), " like features[0], got ", map.scalar_type());
    TORCH_CHECK(map.size(0) == first.size(0) && map.size(1) == first.size(1), name,
                " should have batch size ", first.size(0), " and ", first.size(1),
                " channels like features[0], got shape ", map.sizes());
  }
  check_rois(rois, first.device());
  TORCH_CHECK(levels.device() == first.device(), "levels should be on the same device as the "
              "features (", first.device(), "), got ", levels.device());
  TORCH_CHECK(levels.scalar_type() == at::kLong, "levels should be int64, got ", levels.scalar_type());
  TORCH_CHECK(levels.dim() == 1 && levels.size(0) == rois.size(0),
              "levels should have shape [K] with K = ", rois.size(0), " (one level per roi), got ",
              levels.sizes());
  TORCH_CHECK(spatial_scales.size() == features.size(), "spatial_scales should have one entry per "
              "feature level (", features.size(), "), got ", spatial_scales.size());
}

unsigned launch_blocks(int64_t total) {
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  TORCH_CHECK(blocks <= std::numeric_limits<int>::max(), "roi_align: ", total,
              " elements are too many for one launch");
  return static_cast<unsigned>(blocks);
}

// maps[l] holds ptr_t's pointee type (checked by the callers).
template <typename ptr_t, typename acc_t>
LevelTable<ptr_t, acc_t> make_level_table(at::TensorList maps, at::ArrayRef<double> spatial_scales) {
  LevelTable<ptr_t, acc_t> table{};
  table.num_levels = static_cast<int>(maps.size());
  table.batch_size = maps[0].size(0);
  for (size_t l = 0; l < maps.size(); ++l) {
    const at::Tensor& map = maps[l];
    Level<ptr_t, acc_t>& level = table.level[l];
    level.data = static_cast<ptr_t>(map.data_ptr());
    level.height = static_cast<int>(map.size(2));
    level.width = static_cast<int>(map.size(3));
    level.stride_n = map.stride(0);
    level.stride_c = map.stride(1);
    level.stride_h = map.stride(2);
    level.stride_w = map.stride(3);
    level.spatial_scale = static_cast<acc_t>(spatial_scales[l]);
  }
  return table;
}

// Inputs already checked. levels is undefined for single-level roi_align.
at::Tensor roi_align_forward_impl(at::TensorList features, const at::Tensor& rois,
                                  const at::Tensor& levels, at::ArrayRef<double> spatial_scales,
                                  int64_t pooled_height, int64_t pooled_width,
                                  int64_t sampling_ratio, bool aligned) {
  const at::Tensor& first = features[0];
  const int64_t channels = first.size(1);
  const at::MemoryFormat format = first.suggest_memory_format();
  at::Tensor out = at::empty({rois.size(0), channels, pooled_height, pooled_width},
                             first.options().memory_format(format));
  if (out.numel() == 0) {
    return out;
  }

  at::cuda::CUDAGuard device_guard(first.device());
  const at::Tensor levels_contig = levels.defined() ? levels.contiguous() : at::Tensor();
  const int64_t* levels_ptr = levels.defined() ? levels_contig.data_ptr<int64_t>() : nullptr;
  const int64_t total = out.numel();
  const unsigned blocks = launch_blocks(total);
  const bool channels_last = format == at::MemoryFormat::ChannelsLast;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, first.scalar_type(), "roi_align_forward_cuda", [&] {
    using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    const at::Tensor rois_acc = rois.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
    const auto table = make_level_table<const scalar_t*, acc_t>(features, spatial_scales);
    const auto kernel = channels_last ? roi_align_forward_kernel<scalar_t, acc_t, true>
                                      : roi_align_forward_kernel<scalar_t, acc_t, false>;
    kernel<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        total, table, rois_acc.data_ptr<acc_t>(), levels_ptr, channels,
        static_cast<int>(pooled_height), static_cast<int>(pooled_width),
        static_cast<int>(sampling_ratio), aligned, out.data_ptr<scalar_t>(), out.stride(0),
        out.stride(1), out.stride(2), out.stride(3));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

// What one level's gradient must look like when returned.
struct GradTarget {
  int64_t height;
  int64_t width;
  at::MemoryFormat format;
  at::ScalarType dtype;
};

// Inputs already checked. Returns one [batch_size, channels, H_l, W_l] gradient per target.
std::vector<at::Tensor> roi_align_backward_impl(
    const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& levels,
    at::ArrayRef<double> spatial_scales, int64_t batch_size, int64_t channels,
    const std::vector<GradTarget>& targets, int64_t pooled_height, int64_t pooled_width,
    int64_t sampling_ratio, bool aligned) {
  at::cuda::CUDAGuard device_guard(grad.device());
  const at::ScalarType acc_type = grad.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  std::vector<at::Tensor> buffers;
  buffers.reserve(targets.size());
  for (const GradTarget& target : targets) {
    buffers.push_back(at::zeros({batch_size, channels, target.height, target.width},
                                grad.options().dtype(acc_type).memory_format(target.format)));
  }

  if (grad.numel() > 0) {
    const at::Tensor levels_contig = levels.defined() ? levels.contiguous() : at::Tensor();
    const int64_t* levels_ptr = levels.defined() ? levels_contig.data_ptr<int64_t>() : nullptr;
    const int64_t total = grad.numel();
    const unsigned blocks = launch_blocks(total);
    const bool channels_last = grad.suggest_memory_format() == at::MemoryFormat::ChannelsLast;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "roi_align_backward_cuda", [&] {
      using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;  // the buffers' dtype, acc_type above
      const at::Tensor rois_acc = rois.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
      const auto table = make_level_table<acc_t*, acc_t>(buffers, spatial_scales);
      const auto kernel = channels_last ? roi_align_backward_kernel<scalar_t, acc_t, true>
                                        : roi_align_backward_kernel<scalar_t, acc_t, false>;
      kernel<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          total, grad.data_ptr<scalar_t>(), grad.stride(0), grad.stride(1), grad.stride(2),
          grad.stride(3), table, rois_acc.data_ptr<acc_t>(), levels_ptr, channels,
          static_cast<int>(pooled_height), static_cast<int>(pooled_width),
          static_cast<int>(sampling_ratio), aligned);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }

  std::vector<at::Tensor> grads;
  grads.reserve(targets.size());
  for (size_t l = 0; l < targets.size(); ++l) {
    grads.push_back(buffers[l].to(targets[l].dtype));  // keeps the buffer's memory format
  }
  return grads;
}

// Entry points ----------------------------------------------------------------------------------

at::Tensor roi_align_forward_cuda(const at::Tensor& input, const at::Tensor& rois,
                                  double spatial_scale, int64_t pooled_height,
                                  int64_t pooled_width, int64_t sampling_ratio, bool aligned) {
  check_feature_map(input, "input");
  check_rois(rois, input.device());
  check_pooling(pooled_height, pooled_width, sampling_ratio);
  return roi_align_forward_impl(at::TensorList(input), rois, at::Tensor(),
                                at::ArrayRef<double>(spatial_scale), pooled_height, pooled_width,
                                sampling_ratio, aligned);
}

at::Tensor roi_align_backward_cuda(const at::Tensor& grad, const at::Tensor& rois,
                                   double spatial_scale, int64_t pooled_height,
                                   int64_t pooled_width, int64_t batch_size, int64_t channels,
                                   int64_t height, int64_t width, int64_t sampling_ratio,
                                   bool aligned) {
  TORCH_CHECK(grad.is_cuda(), "grad should be a CUDA tensor, got one on ", grad.device());
  TORCH_CHECK(is_supported_float(grad.scalar_type()),
              "grad should be float16, bfloat16, float32 or float64, got ", grad.scalar_type());
  check_rois(rois, grad.device());
  check_pooling(pooled_height, pooled_width, sampling_ratio);
  TORCH_CHECK(batch_size >= 0 && channels >= 0 && height >= 0 && width >= 0,
              "batch_size, channels, height and width should be non-negative, got ", batch_size,
              ", ", channels, ", ", height, ", ", width);
  TORCH_CHECK(height <= std::numeric_limits<int>::max() && width <= std::numeric_limits<int>::max(),
              "height and width should fit in 32 bits, got ", height, " and ", width);
  TORCH_CHECK(grad.dim() == 4 && grad.size(0) == rois.size(0) && grad.size(1) == channels &&
                  grad.size(2) == pooled_height && grad.size(3) == pooled_width,
              "grad should have shape [", rois.size(0), ", ", channels, ", ", pooled_height, ", ",
              pooled_width, "] (rois, channels, pooled size), got ", grad.sizes());
  const std::vector<GradTarget> targets = {
      {height, width, grad.suggest_memory_format(), grad.scalar_type()}};
  return roi_align_backward_impl(grad, rois, at::Tensor(), at::ArrayRef<double>(spatial_scale),
                                 batch_size, channels, targets, pooled_height, pooled_width,
                                 sampling_ratio, aligned)[0];
}

at::Tensor multi_level_roi_align_forward_cuda(at::TensorList features, const at::Tensor& rois,
                                              const at::Tensor& levels,
                                              at::ArrayRef<double> spatial_scales,
                                              int64_t pooled_height, int64_t pooled_width,
                                              int64_t sampling_ratio, bool aligned) {
  check_levels(features, rois, levels, spatial_scales);
  check_pooling(pooled_height, pooled_width, sampling_ratio);
  return roi_align_forward_impl(features, rois, levels, spatial_scales, pooled_height,
                                pooled_width, sampling_ratio, aligned);
}

std::vector<at::Tensor> multi_level_roi_align_backward_cuda(
    const at::Tensor& grad, at::TensorList features, const at::Tensor& rois,
    const at::Tensor& levels, at::ArrayRef<double> spatial_scales, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio, bool aligned) {
  check_levels(features, rois, levels, spatial_scales);
  check_pooling(pooled_height, pooled_width, sampling_ratio);
  const at::Tensor& first = features[0];
  TORCH_CHECK(grad.device() == first.device(), "grad should be on the same device as the features (",
              first.device(), "), got ", grad.device());
  TORCH_CHECK(grad.scalar_type() == first.scalar_type(), "grad should have the features' dtype ",
              first.scalar_type(), ", got ", grad.scalar_type());
  TORCH_CHECK(grad.dim() == 4 && grad.size(0) == rois.size(0) && grad.size(1) == first.size(1) &&
                  grad.size(2) == pooled_height && grad.size(3) == pooled_width,
              "grad should have shape [", rois.size(0), ", ", first.size(1), ", ", pooled_height,
              ", ", pooled_width, "] (rois, channels, pooled size), got ", grad.sizes());
  std::vector<GradTarget> targets;
  targets.reserve(features.size());
  for (const at::Tensor& map : features) {
    targets.push_back({map.size(2), map.size(3), map.suggest_memory_format(), map.scalar_type()});
  }
  return roi_align_backward_impl(grad, rois, levels, spatial_scales, first.size(0), first.size(1),
                                 targets, pooled_height, pooled_width, sampling_ratio, aligned);
}

}  // namespace

TORCH_LIBRARY_IMPL(lit_amp_det, CUDA, m) {
  m.impl(TORCH_SELECTIVE_NAME("lit_amp_det::roi_align"), TORCH_FN(roi_align_forward_cuda));
  m.impl(TORCH_SELECTIVE_NAME("lit_amp_det::_roi_align_backward"),
         TORCH_FN(roi_align_backward_cuda));
  m.impl(TORCH_SELECTIVE_NAME("lit_amp_det::multi_level_roi_align"),
         TORCH_FN(multi_level_roi_align_forward_cuda));
  m.impl(TORCH_SELECTIVE_NAME("lit_amp_det::_multi_level_roi_align_backward"),
         TORCH_FN(multi_level_roi_align_backward_cuda));
}
