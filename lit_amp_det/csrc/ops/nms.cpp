// Schemas of lit_amp_det::nms, batched_nms and batched_nms_padded (semantics: csrc/README.md).
//
// `max_output` is part of the op rather than a slice done by the caller because the greedy pass can
// stop at the max_output-th kept box, which is where most of NMS' time goes at RPN sizes.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(lit_amp_det, m) {
  m.def("nms(Tensor boxes, Tensor scores, float iou_threshold, int max_output=-1) -> Tensor");
  m.def(
      "batched_nms(Tensor boxes, Tensor scores, Tensor idxs, float iou_threshold, int max_output=-1) -> Tensor");
  // Fixed-size result (kept indices padded with -1, count): a caller that never reads a size never waits.
  m.def(
      "batched_nms_padded(Tensor boxes, Tensor scores, Tensor idxs, Tensor? valid, float iou_threshold, "
      "int max_output=-1, int max_class_size=-1) -> (Tensor, Tensor)");
}
