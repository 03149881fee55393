// Schemas of multi_level_roi_align (RoIAlign over FPN levels, one level per roi, written straight into one
// output in roi order) and its backward (semantics: ../README.md). Kernels live in cpu/ and cuda/.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(lit_amp_det, m) {
  m.def(
      "multi_level_roi_align(Tensor[] features, Tensor rois, Tensor levels, float[] spatial_scales, "
      "int pooled_height, int pooled_width, int sampling_ratio, bool aligned) -> Tensor");
  m.def(
      "_multi_level_roi_align_backward(Tensor grad, Tensor[] features, Tensor rois, Tensor levels, "
      "float[] spatial_scales, int pooled_height, int pooled_width, int sampling_ratio, bool aligned) "
      "-> Tensor[]");
}
