// CUDA kernel of lit_amp_det::box_iou (semantics: csrc/README.md): the [N, M] IoU matrix, computed
// and returned in fp32 for fp16/bf16/fp32 boxes, fp64 when either input is fp64.
#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "exact_math.cuh"

#include <limits>

namespace {

using namespace lit_amp_det::ops::cuda_math;  // NOLINT: exact add/sub/mul/div, box IoU

constexpr int kThreads = 256;

// One thread per output element out[i, j], j fastest: consecutive threads read consecutive boxes2
// rows and write consecutive outputs; boxes1[i] is the same for a whole run of threads.
template <typename scalar_t, typename acc_t>
__global__ void box_iou_kernel(const scalar_t* __restrict__ boxes1,  // [n, 4]
                               const scalar_t* __restrict__ boxes2,  // [m, 4]
                               int64_t n, int64_t m,
                               acc_t* __restrict__ out) {             // [n, m]
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= n * m) {
    return;
  }
  const int64_t i = index / m;
  const int64_t j = index - i * m;
  acc_t a[4];
  acc_t b[4];
#pragma unroll
  for (int d = 0; d < 4; ++d) {
    a[d] = static_cast<acc_t>(boxes1[i * 4 + d]);
    b[d] = static_cast<acc_t>(boxes2[j * 4 + d]);
  }
  out[index] = box_pair_iou(a, b);
}

bool is_supported_float(at::ScalarType type) {
  return type == at::kHalf || type == at::kBFloat16 || type == at::kFloat || type == at::kDouble;
}

at::Tensor box_iou_cuda(const at::Tensor& boxes1, const at::Tensor& boxes2) {
  TORCH_CHECK(boxes1.is_cuda(), "boxes1 should be a CUDA tensor, got one on ", boxes1.device());
  TORCH_CHECK(boxes2.device() == boxes1.device(),
              "boxes1 and boxes2 should be on the same device, got boxes1 on ", boxes1.device(),
              " and boxes2 on ", boxes2.device());
  TORCH_CHECK(boxes1.dim() == 2 && boxes1.size(1) == 4,
              "boxes1 should have shape [N, 4] (x1, y1, x2, y2), got ", boxes1.sizes());
  TORCH_CHECK(boxes2.dim() == 2 && boxes2.size(1) == 4,
              "boxes2 should have shape [M, 4] (x1, y1, x2, y2), got ", boxes2.sizes());
  TORCH_CHECK(is_supported_float(boxes1.scalar_type()),
              "boxes1 should be float16, bfloat16, float32 or float64, got ", boxes1.scalar_type());
  TORCH_CHECK(is_supported_float(boxes2.scalar_type()),
              "boxes2 should be float16, bfloat16, float32 or float64, got ", boxes2.scalar_type());

  // Both inputs in one dtype (a no-op when they already agree; fp16 with bf16 meets in fp32), read
  // natively by the kernel and widened to the accumulation type: fp32, or fp64 if either is fp64.
  const at::ScalarType common = c10::promoteTypes(boxes1.scalar_type(), boxes2.scalar_type());
  const at::ScalarType out_type = common == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t n = boxes1.size(0);
  const int64_t m = boxes2.size(0);
  at::Tensor out = at::empty({n, m}, boxes1.options().dtype(out_type));
  if (out.numel() == 0) {
    return out;
  }

  at::cuda::CUDAGuard device_guard(boxes1.device());
  const at::Tensor a = boxes1.to(common).contiguous();
  const at::Tensor b = boxes2.to(common).contiguous();
  const int64_t blocks = (out.numel() + kThreads - 1) / kThreads;
  TORCH_CHECK(blocks <= std::numeric_limits<int>::max(), "box_iou output of ", n, " x ", m,
              " elements is too large for one launch");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, common, "box_iou_cuda", [&] {
    using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    box_iou_kernel<scalar_t, acc_t>
        <<<static_cast<unsigned>(blocks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
            a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), n, m, out.data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(lit_amp_det, CUDA, m) {
  m.impl(TORCH_SELECTIVE_NAME("lit_amp_det::box_iou"), TORCH_FN(box_iou_cuda));
}
