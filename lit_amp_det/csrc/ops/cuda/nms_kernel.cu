// CUDA kernels of lit_amp_det::nms and lit_amp_det::batched_nms (semantics: csrc/README.md).
//
// Three steps, all on the current stream:
//   1. a stable descending sort of the scores (ties: lower index first);
//   2. nms_mask_kernel: for every sorted box i and every 64-wide block of sorted boxes j > i, one
//      64-bit word whose bit t says "box i suppresses box 64 * block + t" (IoU > threshold, and for
//      batched_nms the same category);
//   3. nms_reduce_kernel: one thread block walks the sorted boxes greedily with a "removed" bitmask,
//      writes the original indices of the kept boxes and stops at the max_output-th kept box.
// The only host synchronisation is reading the kept count back to size the result.
#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "exact_math.cuh"

#include <cmath>
#include <limits>

namespace {

using namespace lit_amp_det::ops::cuda_math;  // NOLINT: exact add/sub/mul/div, box IoU

using mask_t = unsigned long long;
constexpr int kBitsPerWord = 64;       // sorted boxes per mask word, and threads per mask block
constexpr int kReduceThreads = 256;    // the OR of kept rows into "removed" is spread over these
constexpr int64_t kMaxGridY = 65535;   // CUDA's limit on gridDim.y (row blocks of the mask kernel)
constexpr size_t kMaxSharedRemoved = 48 * 1024;  // default dynamic shared memory limit, no opt-in

// Grid (col_blocks, col_blocks), 64 threads. Block (row_block, col_block) fills
// mask[i][col_block] for the 64 sorted rows i of row_block. Only col_block >= row_block is
// computed (and ever read by the reduction); on the diagonal only j > i is tested.
template <typename scalar_t, typename acc_t, bool kBatched>
__global__ void nms_mask_kernel(
    const scalar_t* __restrict__ boxes,  // [n, 4] sorted by score
    const int64_t* __restrict__ idxs,    // [n] sorted categories (kBatched only)
    int64_t n,
    int64_t col_blocks,
    acc_t threshold,
    mask_t* __restrict__ mask) {         // [n, col_blocks]
  const int64_t row_block = blockIdx.y;
  const int64_t col_block = blockIdx.x;
  if (col_block < row_block) {
    return;
  }
  const int64_t row_start = row_block * kBitsPerWord;
  const int64_t col_start = col_block * kBitsPerWord;
  const int rows = static_cast<int>(min(n - row_start, static_cast<int64_t>(kBitsPerWord)));
  const int cols = static_cast<int>(min(n - col_start, static_cast<int64_t>(kBitsPerWord)));

  __shared__ acc_t col_boxes[kBitsPerWord * 4];
  __shared__ int64_t col_idxs[kBitsPerWord];
  const int t = threadIdx.x;
  if (t < cols) {
    const scalar_t* box = boxes + (col_start + t) * 4;
#pragma unroll
    for (int d = 0; d < 4; ++d) {
      col_boxes[t * 4 + d] = static_cast<acc_t>(box[d]);
    }
    if (kBatched) {
      col_idxs[t] = idxs[col_start + t];
    }
  }
  __syncthreads();

  if (t < rows) {
    const int64_t i = row_start + t;
    acc_t row_box[4];
#pragma unroll
    for (int d = 0; d < 4; ++d) {
      row_box[d] = static_cast<acc_t>(boxes[i * 4 + d]);
    }
    const int64_t row_idx = kBatched ? idxs[i] : 0;
    mask_t bits = 0;
    for (int j = (row_block == col_block) ? t + 1 : 0; j < cols; ++j) {
      if (kBatched && col_idxs[j] != row_idx) {
        continue;
      }
      if (box_pair_iou(row_box, col_boxes + j * 4) > threshold) {
        bits |= mask_t{1} << j;
      }
    }
    mask[i * col_blocks + col_block] = bits;
  }
}

// One block of kReduceThreads threads. For each 64-box word b in sorted order:
//   * warp 0 resolves the word serially: box t is kept unless bit t of removed[b] is set (by a kept
//     box of an earlier word, or by a kept box of this word, through the mask's diagonal word);
//     lane 0 writes order[64 * b + t] of every kept box; it stops keeping at max_output;
//   * all threads OR the mask rows of this word's kept boxes into removed[b + 1 ...].
// removed lives in dynamic shared memory, or in removed_global when it does not fit there.
__global__ void __launch_bounds__(kReduceThreads) nms_reduce_kernel(
    const mask_t* __restrict__ mask,    // [n, col_blocks]
    const int64_t* __restrict__ order,  // [n] original index of each sorted box
    int64_t n,
    int64_t col_blocks,
    int64_t max_output,                 // < 0: no limit
    mask_t* removed_global,             // [col_blocks] scratch, or nullptr to use shared memory
    int64_t* __restrict__ keep,         // [n] kept original indices, in sorted order
    int64_t* __restrict__ num_kept) {   // [1]
  extern __shared__ mask_t removed_shared[];
  __shared__ mask_t word_kept;      // written by lane 0 of warp 0, read by all after a barrier
  __shared__ bool limit_reached;
  mask_t* removed = removed_global != nullptr ? removed_global : removed_shared;

  for (int64_t w = threadIdx.x; w < col_blocks; w += blockDim.x) {
    removed[w] = 0;
  }
  __syncthreads();

  const unsigned lane = threadIdx.x % 32;
  int64_t count = 0;  // boxes kept so far; maintained (identically) by the lanes of warp 0 only
  for (int64_t b = 0; b < col_blocks; ++b) {
    const int64_t row_start = b * kBitsPerWord;
    const int rows = static_cast<int>(min(n - row_start, static_cast<int64_t>(kBitsPerWord)));
    if (threadIdx.x < 32) {
      // Diagonal words of this word's 64 rows: lane l holds rows l and l + 32.
      const mask_t diag_lo = lane < rows ? mask[(row_start + lane) * col_blocks + b] : 0;
      const mask_t diag_hi = lane + 32 < rows ? mask[(row_start + lane + 32) * col_blocks + b] : 0;
      mask_t cur = removed[b];
      mask_t kept_bits = 0;
      // Warp-uniform loop: every lane computes the same cur / count, so the shuffles are safe.
      for (int t = 0; t < rows; ++t) {
        const mask_t row_word =
            t < 32 ? __shfl_sync(0xffffffffu, diag_lo, t) : __shfl_sync(0xffffffffu, diag_hi, t - 32);
        const bool limit_hit = max_output >= 0 && count >= max_output;
        if (!((cur >> t) & 1) && !limit_hit) {
          kept_bits |= mask_t{1} << t;
          cur |= row_word;
          if (lane == 0) {
            keep[count] = order[row_start + t];
          }
          ++count;
        }
      }
      if (lane == 0) {
        word_kept = kept_bits;
        limit_reached = max_output >= 0 && count >= max_output;
      }
    }
    __syncthreads();
    const mask_t kept_bits = word_kept;
    if (limit_reached) {
      break;  // uniform: every thread read the same flag after the barrier
    }
    if (kept_bits != 0) {
      for (int64_t w = b + 1 + threadIdx.x; w < col_blocks; w += blockDim.x) {
        mask_t acc = removed[w];
        for (mask_t bits = kept_bits; bits != 0; bits &= bits - 1) {
          const int t = __ffsll(static_cast<long long>(bits)) - 1;
          acc |= mask[(row_start + t) * col_blocks + w];
        }
        removed[w] = acc;
      }
    }
    // removed[b + 1] must be complete before warp 0 reads it, and word_kept / limit_reached must
    // have been read by every thread before warp 0 overwrites them.
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    *num_kept = count;  // thread 0 is lane 0 of warp 0, which holds the count
  }
}

bool is_supported_float(at::ScalarType type) {
  return type == at::kHalf || type == at::kBFloat16 || type == at::kFloat || type == at::kDouble;
}

void check_boxes_and_scores(const at::Tensor& boxes, const at::Tensor& scores) {
  TORCH_CHECK(boxes.is_cuda(), "boxes should be a CUDA tensor, got one on ", boxes.device());
  TORCH_CHECK(scores.device() == boxes.device(),
              "boxes and scores should be on the same device, got boxes on ", boxes.device(),
              " and scores on ", scores.device());
  TORCH_CHECK(boxes.dim() == 2, "boxes should be a 2d tensor, got ", boxes.dim(), "D");
  TORCH_CHECK(boxes.size(1) == 4, "boxes should have 4 columns (x1, y1, x2, y2), got shape ",
              boxes.sizes());
  TORCH_CHECK(scores.dim() == 1, "scores should be a 1d tensor, got ", scores.dim(), "D");
  TORCH_CHECK(scores.size(0) == boxes.size(0), "boxes and scores should have the same number of "
              "elements, got ", boxes.size(0), " boxes and ", scores.size(0), " scores");
  TORCH_CHECK(is_supported_float(boxes.scalar_type()),
              "boxes should be float16, bfloat16, float32 or float64, got ", boxes.scalar_type());
  TORCH_CHECK(is_supported_float(scores.scalar_type()),
              "scores should be float16, bfloat16, float32 or float64, got ", scores.scalar_type());
}

// The threshold in the IoU type, such that `iou > threshold_as<acc_t>(t)` decides exactly `iou > t`
// compared in double, as torchvision's CPU kernel (fp32 IoU against a double threshold) and our CPU
// kernel do: for fp32 that is the largest float <= t. IoUs lie in [0, 1], so clamping t to [-1, 2]
// first changes no decision and keeps the cast to float defined; NaN stays NaN (nothing suppressed).
template <typename acc_t>
acc_t threshold_as(double iou_threshold) {
  double t = iou_threshold;
  if (t > 2.0) {
    t = 2.0;
  } else if (t < -1.0) {
    t = -1.0;
  }
  acc_t rounded = static_cast<acc_t>(t);
  if (static_cast<double>(rounded) > t) {
    rounded = std::nextafter(rounded, -std::numeric_limits<acc_t>::infinity());
  }
  return rounded;
}

// idxs is undefined for plain nms.
at::Tensor nms_impl(const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs,
                    double iou_threshold, int64_t max_output) {
  const int64_t n = boxes.size(0);
  if (n == 0 || max_output == 0) {
    return at::empty({0}, boxes.options().dtype(at::kLong));
  }
  const int64_t col_blocks = (n + kBitsPerWord - 1) / kBitsPerWord;
  TORCH_CHECK(col_blocks <= kMaxGridY, "nms supports at most ", kMaxGridY * kBitsPerWord,
              " boxes, got ", n, "; pre-select the top-scoring boxes first");

  at::cuda::CUDAGuard device_guard(boxes.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  const at::Tensor order =
      std::get<1>(scores.sort(/*stable=*/true, /*dim=*/0, /*descending=*/true)).contiguous();
  const at::Tensor boxes_sorted = boxes.index_select(0, order).contiguous();
  const bool batched = idxs.defined();
  const at::Tensor idxs_sorted =
      batched ? idxs.index_select(0, order).to(at::kLong).contiguous() : at::Tensor();

  // int64 storage reinterpreted as 64-bit masks; left uninitialised below the diagonal (never read)
  at::Tensor mask = at::empty({n, col_blocks}, boxes.options().dtype(at::kLong));
  mask_t* mask_ptr = reinterpret_cast<mask_t*>(mask.data_ptr<int64_t>());
  const int64_t* idxs_ptr = batched ? idxs_sorted.data_ptr<int64_t>() : nullptr;

  const dim3 mask_grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(col_blocks));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, boxes.scalar_type(), "nms_mask_cuda", [&] {
    using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    const acc_t threshold = threshold_as<acc_t>(iou_threshold);
    if (batched) {
      nms_mask_kernel<scalar_t, acc_t, true><<<mask_grid, kBitsPerWord, 0, stream>>>(
          boxes_sorted.data_ptr<scalar_t>(), idxs_ptr, n, col_blocks, threshold, mask_ptr);
    } else {
      nms_mask_kernel<scalar_t, acc_t, false><<<mask_grid, kBitsPerWord, 0, stream>>>(
          boxes_sorted.data_ptr<scalar_t>(), nullptr, n, col_blocks, threshold, mask_ptr);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });

  const size_t removed_bytes = static_cast<size_t>(col_blocks) * sizeof(mask_t);
  const bool removed_in_shared = removed_bytes <= kMaxSharedRemoved;
  at::Tensor removed_global;
  if (!removed_in_shared) {
    removed_global = at::empty({col_blocks}, boxes.options().dtype(at::kLong));
  }
  at::Tensor keep = at::empty({n}, boxes.options().dtype(at::kLong));
  at::Tensor num_kept = at::empty({1}, boxes.options().dtype(at::kLong));
  nms_reduce_kernel<<<1, kReduceThreads, removed_in_shared ? removed_bytes : 0, stream>>>(
      mask_ptr, order.data_ptr<int64_t>(), n, col_blocks, max_output,
      removed_in_shared ? nullptr : reinterpret_cast<mask_t*>(removed_global.data_ptr<int64_t>()),
      keep.data_ptr<int64_t>(), num_kept.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  // the one host synchronisation: the number of kept boxes sizes the result
  const int64_t count = num_kept.item<int64_t>();
  return keep.narrow(0, 0, count);
}

at::Tensor nms_cuda(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold,
                    int64_t max_output) {
  check_boxes_and_scores(boxes, scores);
  return nms_impl(boxes, scores, at::Tensor(), iou_threshold, max_output);
}

at::Tensor batched_nms_cuda(const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs,
                            double iou_threshold, int64_t max_output) {
  check_boxes_and_scores(boxes, scores);
  TORCH_CHECK(idxs.device() == boxes.device(),
              "boxes and idxs should be on the same device, got boxes on ", boxes.device(),
              " and idxs on ", idxs.device());
  TORCH_CHECK(at::isIntegralType(idxs.scalar_type(), /*includeBool=*/false),
              "idxs should be an integer tensor (int64 category ids), got ", idxs.scalar_type());
  TORCH_CHECK(idxs.dim() == 1 && idxs.size(0) == boxes.size(0),
              "idxs should have shape [N] with N = ", boxes.size(0), " (one category per box), got ",
              idxs.sizes());
  return nms_impl(boxes, scores, idxs, iou_threshold, max_output);
}

}  // namespace

TORCH_LIBRARY_IMPL(lit_amp_det, CUDA, m) {
  m.impl(TORCH_SELECTIVE_NAME("lit_amp_det::nms"), TORCH_FN(nms_cuda));
  m.impl(TORCH_SELECTIVE_NAME("lit_amp_det::batched_nms"), TORCH_FN(batched_nms_cuda));
}
