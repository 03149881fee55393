// Device arithmetic shared by the CUDA kernels: IEEE round-to-nearest operations the compiler may not
// contract into FMAs, and the pairwise box IoU built from them.
//
// Exactness matters in two places: an IoU must land on the same side of an NMS threshold as on the CPU
// (tests build boxes exactly at the threshold), and a RoIAlign sampling coordinate that lands exactly on
// -1 or H must do so on the GPU as on the CPU (the in-image test is discontinuous there).
#pragma once

namespace lit_amp_det {
namespace ops {
namespace cuda_math {

__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }

// std::max / std::min semantics (a NaN coordinate yields a NaN union, hence IoU 0 below).
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

}  // namespace cuda_math
}  // namespace ops
}  // namespace lit_amp_det
