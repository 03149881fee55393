// CPU kernel of lit_amp_det::box_iou (semantics: csrc/README.md).
//
// One fused pass over the [N, M] output: boxes2 is turned once into struct-of-arrays with its areas, so
// that each output row is a vectorised loop, and the flat N * M range is split over threads (rows alone
// would not split the common 1 x M or few x M shapes).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace lit_amp_det {
namespace ops {

namespace {

bool is_supported_float(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

void check_boxes(const char* name, const at::Tensor& boxes) {
  TORCH_CHECK(
      boxes.dim() == 2 && boxes.size(1) == 4,
      "box_iou: ", name, " should be a 2-D tensor of shape [N, 4], got shape ", boxes.sizes());
  TORCH_CHECK(
      is_supported_float(boxes.scalar_type()),
      "box_iou: ", name, " should be float16, bfloat16, float32 or float64, got ", boxes.scalar_type());
}

template <typename acc_t>
struct Boxes {
  std::vector<acc_t> x1, y1, x2, y2, area;
};

// [M, 4] boxes (already in acc_t, contiguous) to struct-of-arrays with areas computed once.
template <typename acc_t>
Boxes<acc_t> to_soa(const acc_t* p, int64_t m) {
  Boxes<acc_t> b;
  for (auto* v : {&b.x1, &b.y1, &b.x2, &b.y2, &b.area}) {
    v->resize(m);
  }
  for (int64_t j = 0; j < m; ++j) {
    const acc_t* q = p + 4 * j;
    b.x1[j] = q[0];
    b.y1[j] = q[1];
    b.x2[j] = q[2];
    b.y2[j] = q[3];
    b.area[j] = (q[2] - q[0]) * (q[3] - q[1]);
  }
  return b;
}

// IoU of box `a` (x1, y1, x2, y2) with boxes2[j0:j1], written to out[j0:j1]. torchvision's operation
// order, so fp32/fp64 results match it bit for bit, except 0 instead of NaN/inf when the union is not
// positive: the union is then replaced by +inf, which sends the finite intersection to 0 (and a NaN quotient,
// from infinite or NaN coordinates, becomes 0 too). Selecting the
// divisor rather than the quotient keeps the loop branch-free, hence vectorised (GCC sinks a quotient
// used in one arm of a select into a branch).
template <typename acc_t>
void iou_row(const acc_t* a, const Boxes<acc_t>& b, int64_t j0, int64_t j1, acc_t* out) {
  const acc_t ax1 = a[0], ay1 = a[1], ax2 = a[2], ay2 = a[3];
  const acc_t a_area = (ax2 - ax1) * (ay2 - ay1);
  const acc_t* x1 = b.x1.data();
  const acc_t* y1 = b.y1.data();
  const acc_t* x2 = b.x2.data();
  const acc_t* y2 = b.y2.data();
  const acc_t* area = b.area.data();
  for (int64_t j = j0; j < j1; ++j) {
    const acc_t w = std::max(acc_t(0), std::min(ax2, x2[j]) - std::max(ax1, x1[j]));
    const acc_t h = std::max(acc_t(0), std::min(ay2, y2[j]) - std::max(ay1, y1[j]));
    const acc_t inter = w * h;
    const acc_t uni = a_area + area[j] - inter;
    const acc_t ratio = inter / (uni > acc_t(0) ? uni : std::numeric_limits<acc_t>::infinity());
    out[j] = ratio == ratio ? ratio : acc_t(0);  // inf / inf from infinite coordinates: 0, never NaN
  }
}

template <typename acc_t>
void box_iou_impl(const at::Tensor& boxes1, const at::Tensor& boxes2, at::Tensor& out) {
  const at::Tensor a = boxes1.to(out.scalar_type()).contiguous();  // no copy when already acc_t
  const at::Tensor b2 = boxes2.to(out.scalar_type()).contiguous();
  const int64_t m = b2.size(0);
  const Boxes<acc_t> b = to_soa(b2.data_ptr<acc_t>(), m);
  const acc_t* a_data = a.data_ptr<acc_t>();
  acc_t* out_data = out.data_ptr<acc_t>();
  // ~16k outputs per task: enough to amortise a thread wake-up, small enough to split 20 x 2000.
  constexpr int64_t kGrain = 1 << 14;
  at::parallel_for(0, out.numel(), kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end;) {
      const int64_t i = k / m;
      const int64_t j0 = k - i * m;
      const int64_t j1 = std::min(m, j0 + (end - k));
      iou_row(a_data + 4 * i, b, j0, j1, out_data + i * m);
      k += j1 - j0;
    }
  });
}

at::Tensor box_iou_kernel(const at::Tensor& boxes1, const at::Tensor& boxes2) {
  check_boxes("boxes1", boxes1);
  check_boxes("boxes2", boxes2);
  TORCH_CHECK(
      boxes1.device() == boxes2.device(),
      "box_iou: boxes1 and boxes2 should be on the same device, got ", boxes1.device(), " and ", boxes2.device());
  const bool fp64 = boxes1.scalar_type() == at::kDouble || boxes2.scalar_type() == at::kDouble;
  at::Tensor out = at::empty({boxes1.size(0), boxes2.size(0)}, boxes1.options().dtype(fp64 ? at::kDouble : at::kFloat));
  if (out.numel() == 0) {
    return out;
  }
  if (fp64) {
    box_iou_impl<double>(boxes1, boxes2, out);
  } else {
    box_iou_impl<float>(boxes1, boxes2, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(lit_amp_det, CPU, m) {
  m.impl(TORCH_SELECTIVE_NAME("lit_amp_det::box_iou"), TORCH_FN(box_iou_kernel));
}

}  // namespace ops
}  // namespace lit_amp_det
