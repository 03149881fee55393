// Schemas of roi_align and its backward (semantics: ../README.md). Kernels live in cpu/ and cuda/.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(lit_amp_det, m) {
  m.def(
      "roi_align(Tensor input, Tensor rois, float spatial_scale, int pooled_height, int pooled_width, "
      "int sampling_ratio, bool aligned) -> Tensor");
  m.def(
      "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, int pooled_height, "
      "int pooled_width, int batch_size, int channels, int height, int width, int sampling_ratio, "
      "bool aligned) -> Tensor");
}
