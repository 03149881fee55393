// Schema of lit_amp_det::box_iou (semantics: csrc/README.md).
//
// One fused op instead of torchvision's chain of broadcast tensor ops, which materialises several
// [N, M, 2] intermediates; not differentiable, so no autograd registration goes with it.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(lit_amp_det, m) {
  m.def("box_iou(Tensor boxes1, Tensor boxes2) -> Tensor");
}
