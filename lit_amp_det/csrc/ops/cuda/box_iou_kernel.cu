// CUDA kernel of lit_amp_det::box_iou (semantics: csrc/README.md): the [N, M] IoU matrix, computed
// and returned in fp32 for fp16/bf16/fp32 boxes, fp64 when either input is fp64.
#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

namespace {

constexpr int kThreads = 256;

// IEEE round-to-nearest arithmetic the compiler may not contract into FMAs, so the IoU is bit-identical
// to the CPU kernel's and to the one NMS thresholds.
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }

template <typename T>
__device__ __forceinline__ T max_of(T a, T b) { return a < b ? b : a; }
template <typename T>
__device__ __forceinline__ T min_of(T a, T b) { return b < a ? b : a; }

// IoU of boxes a and b (x1, y1, x2, y2); 0 when the union is not positive, so never NaN.
template <typename T>
__device__ __forceinline__ T box_pair_iou(const T* a, const T* b) {
  const T area_a = mul_rn(sub_rn(a[2], a[0]), sub_rn(a[3], a[1]));
  const T area_b = mul_rn(sub_rn(b[2], b[0]), sub_rn(b[3], b[1]));
  const T w = max_of(sub_rn(min_of(a[2], b[2]), max_of(a[0], b[0])), T(0));
  const T h = max_of(sub_rn(min_of(a[3], b[3]), max_of(a[1], b[1])), T(0));
  const T inter = mul_rn(w, h);
  const T uni = sub_rn(add_rn(area_a, area_b), inter);
  return uni > T(0) ? div_rn(inter, uni) : T(0);
}

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
