// CPU kernels of lit_amp_det::nms, batched_nms and batched_nms_padded (semantics: csrc/README.md).
//
// Same greedy as torchvision, written "pull" instead of "push": candidates are visited in decreasing
// score order and each one is tested only against the boxes already kept (of its own class); it is kept
// unless one of them has IoU > iou_threshold with it. That is the same decision, with the same IoU
// arithmetic, as torchvision's loop makes for it, so the result is identical, but:
//  * `max_output` ends the whole pass at the max_output-th keep, so an RPN call (12000 candidates,
//    2000 kept) costs ~2000^2 / 2 IoUs instead of N * kept;
//  * a suppressed candidate stops at the first block of kept boxes that covers it;
//  * the kept boxes live in contiguous struct-of-arrays storage, so the IoU test is a vectorised loop.
// batched_nms is the same pass with one kept list per class: it yields the global score order and the
// global early stop directly, without the coordinate-offset trick or one NMS call per class.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace lit_amp_det {
namespace ops {

namespace {

// ---------------------------------------------------------------------------------------------------
// Input checks

bool is_supported_float(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

void check_boxes_and_scores(const char* op, const at::Tensor& boxes, const at::Tensor& scores) {
  TORCH_CHECK(
      boxes.dim() == 2 && boxes.size(1) == 4,
      op, ": boxes should be a 2-D tensor of shape [N, 4], got shape ", boxes.sizes());
  TORCH_CHECK(
      scores.dim() == 1 && scores.size(0) == boxes.size(0),
      op, ": scores should be a 1-D tensor of shape [", boxes.size(0), "] (one per box), got shape ",
      scores.sizes());
  TORCH_CHECK(
      boxes.device() == scores.device(),
      op, ": boxes and scores should be on the same device, got boxes on ", boxes.device(),
      " and scores on ", scores.device());
  TORCH_CHECK(
      is_supported_float(boxes.scalar_type()),
      op, ": boxes should be float16, bfloat16, float32 or float64, got ", boxes.scalar_type());
  TORCH_CHECK(
      is_supported_float(scores.scalar_type()),
      op, ": scores should be float16, bfloat16, float32 or float64, got ", scores.scalar_type());
  // Candidate indices are stored as int32 to halve the memory traffic of the sort.
  TORCH_CHECK(
      boxes.size(0) <= std::numeric_limits<int32_t>::max(),
      op, ": at most 2^31 - 1 boxes are supported, got ", boxes.size(0));
}

void check_idxs(const at::Tensor& boxes, const at::Tensor& idxs) {
  TORCH_CHECK(
      idxs.dim() == 1 && idxs.size(0) == boxes.size(0),
      "batched_nms: idxs should be a 1-D tensor of shape [", boxes.size(0), "] (one class per box), got shape ",
      idxs.sizes());
  TORCH_CHECK(
      idxs.device() == boxes.device(),
      "batched_nms: idxs should be on the same device as boxes (", boxes.device(), "), got ", idxs.device());
  TORCH_CHECK(
      at::isIntegralType(idxs.scalar_type(), /*includeBool=*/false),
      "batched_nms: idxs should be an integer tensor (int64 class ids), got ", idxs.scalar_type());
}

at::Tensor empty_indices(const at::Tensor& like) {
  return at::empty({0}, like.options().dtype(at::kLong));
}

// ---------------------------------------------------------------------------------------------------
// Stable descending order of the scores.
//
// Scores become unsigned keys whose ascending order is the descending score order; a stable LSD radix
// sort on them starting from index order then gives torchvision's `sort(stable=True, descending=True)`
// (ties: lower index first) in O(N), several times faster than a comparison sort at RPN sizes.

template <typename Key>
struct Keyed {
  Key key;
  int32_t index;
};

// Ascending order of the IEEE bit pattern flipped so that larger floats come first. NaN is made the
// largest value and -0.0 equal to +0.0, as torch.sort treats them.
uint32_t descending_key(float s) {
  if (std::isnan(s)) {
    s = std::numeric_limits<float>::quiet_NaN();
  } else if (s == 0.f) {
    s = 0.f;
  }
  uint32_t u;
  std::memcpy(&u, &s, sizeof(u));
  const uint32_t ascending = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ~ascending;
}

uint64_t descending_key(double s) {
  if (std::isnan(s)) {
    s = std::numeric_limits<double>::quiet_NaN();
  } else if (s == 0.0) {
    s = 0.0;
  }
  uint64_t u;
  std::memcpy(&u, &s, sizeof(u));
  const uint64_t ascending = (u & 0x8000000000000000ull) ? ~u : (u | 0x8000000000000000ull);
  return ~ascending;
}

// Stable ascending sort of `items` by key (LSD radix, one byte per pass). All byte histograms are
// collected in one scan, and a pass whose byte is the same for every item (common for the high
// bytes of scores in [0, 1]) is skipped.
template <typename Key>
void radix_sort(std::vector<Keyed<Key>>& items) {
  constexpr int kPasses = sizeof(Key);
  const int64_t n = static_cast<int64_t>(items.size());
  if (n < 2) {
    return;
  }
  std::vector<std::array<int64_t, 256>> histograms(kPasses);
  for (auto& h : histograms) {
    h.fill(0);
  }
  for (const auto& item : items) {
    for (int p = 0; p < kPasses; ++p) {
      ++histograms[p][(item.key >> (8 * p)) & 0xff];
    }
  }
  std::vector<Keyed<Key>> scratch(items.size());
  for (int p = 0; p < kPasses; ++p) {
    auto& h = histograms[p];
    if (h[(items[0].key >> (8 * p)) & 0xff] == n) {
      continue;
    }
    int64_t start = 0;
    for (auto& count : h) {
      const int64_t c = count;
      count = start;
      start += c;
    }
    for (const auto& item : items) {
      scratch[h[(item.key >> (8 * p)) & 0xff]++] = item;
    }
    items.swap(scratch);
  }
}

template <typename score_t, typename Key>
std::vector<int32_t> sorted_indices(const at::Tensor& scores) {
  const at::Tensor s = scores.contiguous();
  const score_t* data = s.data_ptr<score_t>();
  const int64_t n = s.numel();
  std::vector<Keyed<Key>> items(n);
  for (int64_t i = 0; i < n; ++i) {
    items[i] = {descending_key(data[i]), static_cast<int32_t>(i)};
  }
  radix_sort(items);
  std::vector<int32_t> order(n);
  for (int64_t i = 0; i < n; ++i) {
    order[i] = items[i].index;
  }
  return order;
}

// Box indices by decreasing score, ties by increasing index.
std::vector<int32_t> descending_order(const at::Tensor& scores) {
  if (scores.scalar_type() == at::kDouble) {
    return sorted_indices<double, uint64_t>(scores);
  }
  // fp16 and bf16 scores are exact in fp32, so their order is that of their fp32 values.
  return sorted_indices<float, uint32_t>(scores.to(at::kFloat));
}

// ---------------------------------------------------------------------------------------------------
// Classes of batched_nms

// Dense class id (0 .. C-1) of every box, and how many boxes each class has.
struct Classes {
  std::vector<int32_t> of_box;
  std::vector<int64_t> sizes;
};

// Ids spanning a small range (FPN levels, dataset labels): a lookup table indexed by id - lo.
Classes dense_classes_by_table(const int64_t* v, int64_t n, int64_t lo, uint64_t span) {
  Classes classes;
  classes.of_box.resize(n);
  std::vector<int32_t> dense(span + 1, -1);
  for (int64_t i = 0; i < n; ++i) {
    int32_t& d = dense[static_cast<uint64_t>(v[i]) - static_cast<uint64_t>(lo)];
    if (d < 0) {
      d = static_cast<int32_t>(classes.sizes.size());
      classes.sizes.push_back(0);
    }
    classes.of_box[i] = d;
    ++classes.sizes[d];
  }
  return classes;
}

// Arbitrary int64 ids: binary search in the sorted distinct values.
Classes dense_classes_by_sorting(const int64_t* v, int64_t n) {
  std::vector<int64_t> distinct(v, v + n);
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  Classes classes;
  classes.of_box.resize(n);
  classes.sizes.assign(distinct.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    const auto d = std::lower_bound(distinct.begin(), distinct.end(), v[i]) - distinct.begin();
    classes.of_box[i] = static_cast<int32_t>(d);
    ++classes.sizes[d];
  }
  return classes;
}

Classes dense_classes(const at::Tensor& idxs) {
  const at::Tensor ids = idxs.to(at::kLong).contiguous();
  const int64_t* v = ids.data_ptr<int64_t>();
  const int64_t n = ids.numel();
  const auto [lo, hi] = std::minmax_element(v, v + n);
  // Unsigned difference: hi - lo may not fit in int64.
  const uint64_t span = static_cast<uint64_t>(*hi) - static_cast<uint64_t>(*lo);
  if (span < static_cast<uint64_t>(4 * n + 1024)) {
    return dense_classes_by_table(v, n, *lo, span);
  }
  return dense_classes_by_sorting(v, n);
}

// ---------------------------------------------------------------------------------------------------
// Greedy pass

template <typename acc_t>
struct Box {
  acc_t x1, y1, x2, y2, area;
};

// Where each class keeps its boxes: class c owns slots [begin[c], begin[c] + min(its size, limit)) of one
// shared KeptBoxes of `capacity` slots. `class_of` is the dense class of each box; nullptr for plain nms.
struct ClassSlots {
  const int32_t* class_of;
  std::vector<int64_t> begin;
  int64_t capacity;
};

// Kept boxes of all classes in one struct-of-arrays (slots as in ClassSlots).
template <typename acc_t>
struct KeptBoxes {
  explicit KeptBoxes(int64_t capacity)
      : x1(capacity), y1(capacity), x2(capacity), y2(capacity), area(capacity) {}

  void store(int64_t slot, const Box<acc_t>& b) {
    x1[slot] = b.x1;
    y1[slot] = b.y1;
    x2[slot] = b.x2;
    y2[slot] = b.y2;
    area[slot] = b.area;
  }

  std::vector<acc_t> x1, y1, x2, y2, area;
};

// iou (computed in acc_t) > threshold (double), decided in acc_t so that the test vectorises: for
// float this is `iou > t` with t the largest float <= threshold, which is exactly torchvision's
// float-vs-double comparison (NaN stays NaN: nothing is suppressed).
template <typename acc_t>
acc_t threshold_in(double threshold) {
  if constexpr (std::is_same_v<acc_t, double>) {
    return threshold;
  } else {
    float t = static_cast<float>(threshold);
    if (static_cast<double>(t) > threshold) {
      t = std::nextafter(t, -std::numeric_limits<float>::infinity());
    }
    return t;
  }
}

// The contract's IoU: torchvision's operation order (so results match bit for bit), but 0 instead of
// NaN/inf when the union is not positive (zero-area boxes never suppress): the union is then replaced
// by +inf, which sends the finite intersection to 0. Selecting the divisor rather than the quotient
// matters for speed: GCC (with its default -ftrapping-math) sinks a quotient used in one arm of a
// select into a branch, and the loop is then not vectorised.
template <typename acc_t>
inline acc_t iou(acc_t ax1, acc_t ay1, acc_t ax2, acc_t ay2, acc_t a_area, const Box<acc_t>& b) {
  const acc_t w = std::max(acc_t(0), std::min(ax2, b.x2) - std::max(ax1, b.x1));
  const acc_t h = std::max(acc_t(0), std::min(ay2, b.y2) - std::max(ay1, b.y1));
  const acc_t inter = w * h;
  const acc_t uni = a_area + b.area - inter;
  return inter / (uni > acc_t(0) ? uni : std::numeric_limits<acc_t>::infinity());
}

// Integer of the same width as acc_t, so the OR-reduction below vectorises without conversions.
template <typename acc_t>
using mask_t = std::conditional_t<sizeof(acc_t) == 8, int64_t, int32_t>;

// Does any of the kept boxes [begin, begin + count) overlap `b` by more than `threshold`? No early exit
// inside, so that the loop is a straight vectorised OR-reduction.
template <typename acc_t>
inline bool overlaps_any(const KeptBoxes<acc_t>& k, int64_t begin, int64_t count, const Box<acc_t>& b,
                         acc_t threshold) {
  const acc_t* x1 = k.x1.data() + begin;
  const acc_t* y1 = k.y1.data() + begin;
  const acc_t* x2 = k.x2.data() + begin;
  const acc_t* y2 = k.y2.data() + begin;
  const acc_t* area = k.area.data() + begin;
  mask_t<acc_t> hit = 0;
  for (int64_t j = 0; j < count; ++j) {
    hit |= static_cast<mask_t<acc_t>>(iou(x1[j], y1[j], x2[j], y2[j], area[j], b) > threshold);
  }
  return hit != 0;
}

// Kept boxes are scanned in fixed-size blocks (a compile-time trip count, fully vectorised) with an
// early exit between blocks: a suppressed candidate usually stops within its first few blocks.
template <typename acc_t>
bool is_suppressed(const KeptBoxes<acc_t>& k, int64_t begin, int64_t end, const Box<acc_t>& b, acc_t threshold) {
  constexpr int64_t kBlock = 64 / sizeof(acc_t) * 2;
  int64_t j = begin;
  for (; j + kBlock <= end; j += kBlock) {
    if (overlaps_any(k, j, kBlock, b, threshold)) {
      return true;
    }
  }
  return overlaps_any(k, j, end - j, b, threshold);
}

template <typename acc_t>
Box<acc_t> load_box(const acc_t* boxes, int64_t i) {
  const acc_t* p = boxes + 4 * i;
  return {p[0], p[1], p[2], p[3], (p[2] - p[0]) * (p[3] - p[1])};
}

// The greedy pass over `boxes` ([N, 4] in acc_t) in visiting order `order`.
template <typename acc_t>
std::vector<int64_t> greedy_nms(const acc_t* boxes, const std::vector<int32_t>& order, const ClassSlots& slots,
                                double iou_threshold, int64_t limit) {
  const acc_t threshold = threshold_in<acc_t>(iou_threshold);
  KeptBoxes<acc_t> kept(slots.capacity);
  std::vector<int64_t> class_end = slots.begin;  // one past the last kept slot of each class
  std::vector<int64_t> keep;
  keep.reserve(limit);
  for (const int32_t i : order) {
    const int32_t c = slots.class_of ? slots.class_of[i] : 0;
    const Box<acc_t> b = load_box(boxes, i);
    if (is_suppressed(kept, slots.begin[c], class_end[c], b, threshold)) {
      continue;
    }
    kept.store(class_end[c]++, b);
    keep.push_back(i);
    if (static_cast<int64_t>(keep.size()) == limit) {
      break;
    }
  }
  return keep;
}

at::Tensor to_tensor(const std::vector<int64_t>& keep, const at::Tensor& like) {
  at::Tensor out = at::empty({static_cast<int64_t>(keep.size())}, like.options().dtype(at::kLong));
  std::copy(keep.begin(), keep.end(), out.data_ptr<int64_t>());
  return out;
}

// The greedy pass over `order` in the contract's accumulation type: fp32 for fp16/bf16/fp32 boxes, fp64 for fp64.
std::vector<int64_t> greedy_in_acc(const at::Tensor& boxes, const std::vector<int32_t>& order, const ClassSlots& slots,
                                   double iou_threshold, int64_t limit) {
  if (boxes.scalar_type() == at::kDouble) {
    const at::Tensor b = boxes.contiguous();
    return greedy_nms(b.data_ptr<double>(), order, slots, iou_threshold, limit);
  }
  const at::Tensor b = boxes.to(at::kFloat).contiguous();  // no copy for contiguous fp32 boxes
  return greedy_nms(b.data_ptr<float>(), order, slots, iou_threshold, limit);
}

at::Tensor run_nms(const at::Tensor& boxes, const at::Tensor& scores, const ClassSlots& slots, double iou_threshold,
                   int64_t limit) {
  return to_tensor(greedy_in_acc(boxes, descending_order(scores), slots, iou_threshold, limit), boxes);
}

// max_output < 0 means "no limit".
int64_t keep_limit(int64_t n, int64_t max_output) {
  return max_output < 0 ? n : std::min(n, max_output);
}

// ---------------------------------------------------------------------------------------------------
// Kernels

at::Tensor nms_kernel(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold, int64_t max_output) {
  check_boxes_and_scores("nms", boxes, scores);
  const int64_t limit = keep_limit(boxes.size(0), max_output);
  if (limit == 0) {
    return empty_indices(boxes);
  }
  return run_nms(boxes, scores, ClassSlots{nullptr, {0}, limit}, iou_threshold, limit);
}

// One kept list per class (ClassSlots); `classes` must outlive the result.
ClassSlots class_slots(const Classes& classes, int64_t limit) {
  ClassSlots slots{classes.of_box.data(), std::vector<int64_t>(classes.sizes.size()), 0};
  for (size_t c = 0; c < classes.sizes.size(); ++c) {
    slots.begin[c] = slots.capacity;
    // A class never keeps more than its boxes, nor more than the global limit.
    slots.capacity += std::min(classes.sizes[c], limit);
  }
  return slots;
}

at::Tensor batched_nms_kernel(const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs,
                              double iou_threshold, int64_t max_output) {
  check_boxes_and_scores("batched_nms", boxes, scores);
  check_idxs(boxes, idxs);
  const int64_t limit = keep_limit(boxes.size(0), max_output);
  if (limit == 0) {
    return empty_indices(boxes);
  }
  const Classes classes = dense_classes(idxs);
  return run_nms(boxes, scores, class_slots(classes, limit), iou_threshold, limit);
}

// batched_nms with a fixed-size result, so that the caller never reads a size from the device: the kept indices
// padded with -1 to min(N, max_output), and their count as a 0-d tensor. Boxes whose `valid` is false are skipped
// (neither kept nor suppressing). `max_class_size` is a hint for the CUDA kernel's mask size; unused here.
std::tuple<at::Tensor, at::Tensor> batched_nms_padded_kernel(
    const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs, const std::optional<at::Tensor>& valid,
    double iou_threshold, int64_t max_output, int64_t max_class_size) {
  check_boxes_and_scores("batched_nms_padded", boxes, scores);
  check_idxs(boxes, idxs);
  const int64_t n = boxes.size(0);
  if (valid.has_value()) {
    TORCH_CHECK(
        valid->scalar_type() == at::kBool && valid->dim() == 1 && valid->size(0) == n &&
            valid->device() == boxes.device(),
        "batched_nms_padded: valid should be a bool tensor of shape [", n, "] on ", boxes.device(), ", got ",
        valid->scalar_type(), " ", valid->sizes(), " on ", valid->device());
  }
  const int64_t limit = keep_limit(n, max_output);
  at::Tensor padded = at::full({limit}, -1, boxes.options().dtype(at::kLong));
  at::Tensor count = at::zeros({}, boxes.options().dtype(at::kLong));
  if (limit == 0) {
    return {padded, count};
  }
  std::vector<int32_t> order = descending_order(scores);
  if (valid.has_value()) {
    const at::Tensor v = valid->contiguous();
    const bool* is_valid = v.data_ptr<bool>();
    order.erase(std::remove_if(order.begin(), order.end(), [&](int32_t i) { return !is_valid[i]; }), order.end());
  }
  const Classes classes = dense_classes(idxs);
  const std::vector<int64_t> keep = greedy_in_acc(boxes, order, class_slots(classes, limit), iou_threshold, limit);
  std::copy(keep.begin(), keep.end(), padded.data_ptr<int64_t>());
  count.fill_(static_cast<int64_t>(keep.size()));
  return {padded, count};
}

}  // namespace

TORCH_LIBRARY_IMPL(lit_amp_det, CPU, m) {
  m.impl(TORCH_SELECTIVE_NAME("lit_amp_det::nms"), TORCH_FN(nms_kernel));
  m.impl(TORCH_SELECTIVE_NAME("lit_amp_det::batched_nms"), TORCH_FN(batched_nms_kernel));
  m.impl(TORCH_SELECTIVE_NAME("lit_amp_det::batched_nms_padded"), TORCH_FN(batched_nms_padded_kernel));
}

}  // namespace ops
}  // namespace lit_amp_det
