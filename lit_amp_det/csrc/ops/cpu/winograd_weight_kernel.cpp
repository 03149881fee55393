// CPU kernels of the Winograd weight transforms (semantics: csrc/README.md), one memory pass each:
//
//   weight tiles     U = G w G^T     of each 3x3 filter w (or of the filter rotated by 180 degrees, with input and
//                                    output channels swapped: the input gradient's convolution), written as the
//                                    [alpha^2, rows, columns] right-hand operands of the per-position matrix products
//   weight gradient  dw = A'^T s A'  of each filter's alpha x alpha sum of products s (F(3x3, m x m)), written into
//                                    a [C_out, C_in, 3, 3] gradient of any memory format
//
// Both run a block of up to kLanes filters at a time: the block's values are widened into L1 buffers with one row per
// tap or position, the separable transform (3 -> alpha along one axis, then the other) runs over those rows in the
// accumulation type (float for float/half/bfloat16, double for double), and the results are narrowed into the
// destination. The filters of a block are consecutive in the destination's innermost dimension, so every store of a
// transformed row is contiguous; the weight is read through its strides (no copy of channels_last weights).
//
// They replace a [alpha^2, 9] @ [9, C_out * C_in] matrix product (and a transposing copy) whose 9-long inner
// dimension left it far from memory speed: 2.6 ms for a 256 -> 256 layer's F(4x4) tiles inside a training step.
//
// G (alpha x 3):     F(2x2): [1 0 0; 1/2 1/2 1/2; 1/2 -1/2 1/2; 0 0 1]
//                    F(4x4): [1/4 0 0; -1/6 -1/6 -1/6; -1/6 1/6 -1/6; 1/24 1/12 1/6; 1/24 -1/12 1/6; 0 0 1]
// A'^T (3 x alpha):  F(2x2): [1 1 1 0; 0 1 -1 0; 0 1 1 1]
//                    F(4x4): [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 1]
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bf16_bits.h"
#include "multiversion.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace lit_amp_det {
namespace ops {

namespace {

constexpr int64_t kLanes = 32;  // filters per block row: 36 rows of 32 fp32 = 4.5 KB
constexpr int64_t kRows = 16;   // block rows of the weight tiles, read together (18 KB of fp32 taps)

template <typename scalar_t, typename acc_t>
__attribute__((always_inline)) inline acc_t widen(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return bf16_bits_to_float(*reinterpret_cast<const uint16_t*>(p));
  } else {
    return static_cast<acc_t>(*p);
  }
}

template <typename scalar_t, typename acc_t>
__attribute__((always_inline)) inline void narrow(acc_t value, scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    *reinterpret_cast<uint16_t*>(p) = float_to_bf16_bits(value);
  } else {
    *p = static_cast<scalar_t>(value);
  }
}

// out[a] = (G v)[a] for the alpha rows of G, over n lanes; v0..v2 and each out[a] are rows of kLanes.
template <int m, typename acc_t>
__attribute__((always_inline)) inline void filter_transform(const acc_t* v0, const acc_t* v1, const acc_t* v2,
                                                            acc_t* const* out, int64_t n) {
  if constexpr (m == 2) {
    for (int64_t l = 0; l < n; ++l) {
      const acc_t even = v0[l] + v2[l];
      out[0][l] = v0[l];
      out[1][l] = acc_t(0.5) * (even + v1[l]);
      out[2][l] = acc_t(0.5) * (even - v1[l]);
      out[3][l] = v2[l];
    }
  } else {
    for (int64_t l = 0; l < n; ++l) {
      const acc_t even = v0[l] + v2[l], even4 = v0[l] + acc_t(4) * v2[l], odd2 = acc_t(2) * v1[l];
      out[0][l] = acc_t(0.25) * v0[l];
      out[1][l] = acc_t(-1.0 / 6) * (even + v1[l]);
      out[2][l] = acc_t(-1.0 / 6) * (even - v1[l]);
      out[3][l] = acc_t(1.0 / 24) * (even4 + odd2);
      out[4][l] = acc_t(1.0 / 24) * (even4 - odd2);
      out[5][l] = v2[l];
    }
  }
}

// out[r] = (A'^T s)[r] for the 3 rows of A'^T, over n lanes; s[a] are the alpha input rows.
template <int m, typename acc_t>
__attribute__((always_inline)) inline void gradient_back_transform(const acc_t* const* s, acc_t* out0, acc_t* out1,
                                                                   acc_t* out2, int64_t n) {
  if constexpr (m == 2) {
    for (int64_t l = 0; l < n; ++l) {
      out0[l] = s[0][l] + s[1][l] + s[2][l];
      out1[l] = s[1][l] - s[2][l];
      out2[l] = s[1][l] + s[2][l] + s[3][l];
    }
  } else {
    for (int64_t l = 0; l < n; ++l) {
      const acc_t sum12 = s[1][l] + s[2][l], dif12 = s[1][l] - s[2][l];
      const acc_t sum34 = s[3][l] + s[4][l], dif34 = s[3][l] - s[4][l];
      out0[l] = s[0][l] + sum12 + sum34;
      out1[l] = dif12 + acc_t(2) * dif34;
      out2[l] = sum12 + acc_t(4) * sum34 + s[5][l];
    }
  }
}

// Where the weight tiles' block reads and writes: filter l of block row r has its taps at weight + r * row_stride +
// l * lane_stride + taps[k] (k = 3 * row + column of the filter as transformed), and its tile position p goes to
// out + p * plane + r * out_row_stride + l.
template <typename scalar_t>
struct TileBlock {
  const scalar_t* weight;
  int64_t row_stride, lane_stride;
  const int64_t* taps;
  scalar_t* out;
  int64_t plane, out_row_stride;
};

// U = G w G^T of nr <= kRows rows of n <= kLanes filters. The filters are read in whichever order walks the weight's
// memory: along the lanes when they are its smaller stride (the input gradient's tiles), else along the rows (the
// forward's, whose lanes are output channels, 9 * C_in apart), so that each cache line is read once.
template <int m, typename scalar_t>
__attribute__((always_inline)) inline void tile_block(const TileBlock<scalar_t>& block, int64_t nr, int64_t n) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int alpha = m + 2;
  alignas(64) acc_t w[kRows][9][kLanes];
  alignas(64) acc_t h[alpha * 3][kLanes];  // G w: alpha rows of 3
  alignas(64) acc_t u[alpha * alpha][kLanes];
  if (block.lane_stride <= block.row_stride) {
    for (int64_t r = 0; r < nr; ++r) {
      for (int k = 0; k < 9; ++k) {
        const scalar_t* src = block.weight + r * block.row_stride + block.taps[k];
        for (int64_t l = 0; l < n; ++l) w[r][k][l] = widen<scalar_t, acc_t>(src + l * block.lane_stride);
      }
    }
  } else {
    for (int64_t l = 0; l < n; ++l) {
      for (int k = 0; k < 9; ++k) {
        const scalar_t* src = block.weight + l * block.lane_stride + block.taps[k];
        for (int64_t r = 0; r < nr; ++r) w[r][k][l] = widen<scalar_t, acc_t>(src + r * block.row_stride);
      }
    }
  }
  for (int64_t r = 0; r < nr; ++r) {
    for (int j = 0; j < 3; ++j) {  // each column of the filter: G w[:, j]
      acc_t* rows[alpha];
      for (int a = 0; a < alpha; ++a) rows[a] = h[3 * a + j];
      filter_transform<m>(w[r][j], w[r][3 + j], w[r][6 + j], rows, n);
    }
    for (int a = 0; a < alpha; ++a) {  // each row of G w: (G w G^T)[a, :]
      acc_t* rows[alpha];
      for (int b = 0; b < alpha; ++b) rows[b] = u[alpha * a + b];
      filter_transform<m>(h[3 * a], h[3 * a + 1], h[3 * a + 2], rows, n);
    }
    for (int p = 0; p < alpha * alpha; ++p) {
      scalar_t* dst = block.out + p * block.plane + r * block.out_row_stride;
      for (int64_t l = 0; l < n; ++l) narrow<scalar_t, acc_t>(u[p][l], dst + l);
    }
  }
}

// Where the weight gradient's block reads and writes: filter l's position p is at sums + p * plane + l (the sums in
// the accumulation type), and its tap (i, j) goes to grad + l * lane_stride + taps[3 * i + j].
template <typename scalar_t>
struct GradientBlock {
  const at::opmath_type<scalar_t>* sums;
  int64_t plane;
  scalar_t* grad;
  int64_t lane_stride;
  const int64_t* taps;
};

// dw = A'^T s A' of n <= kLanes filters.
template <int m, typename scalar_t>
__attribute__((always_inline)) inline void gradient_block(const GradientBlock<scalar_t>& block, int64_t n) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int alpha = m + 2;
  alignas(64) acc_t s[alpha * alpha][kLanes];
  alignas(64) acc_t t[3 * alpha][kLanes];  // A'^T s: 3 rows of alpha
  alignas(64) acc_t g[9][kLanes];
  for (int p = 0; p < alpha * alpha; ++p) {
    const acc_t* src = block.sums + p * block.plane;
    for (int64_t l = 0; l < n; ++l) s[p][l] = src[l];
  }
  for (int b = 0; b < alpha; ++b) {  // each column: A'^T s[:, b]
    const acc_t* column[alpha];
    for (int a = 0; a < alpha; ++a) column[a] = s[alpha * a + b];
    gradient_back_transform<m>(column, t[b], t[alpha + b], t[2 * alpha + b], n);
  }
  for (int i = 0; i < 3; ++i) {  // each row of A'^T s: (A'^T s A')[i, :]
    const acc_t* row[alpha];
    for (int b = 0; b < alpha; ++b) row[b] = t[alpha * i + b];
    gradient_back_transform<m>(row, g[3 * i], g[3 * i + 1], g[3 * i + 2], n);
  }
  for (int k = 0; k < 9; ++k) {
    scalar_t* dst = block.grad + block.taps[k];
    for (int64_t l = 0; l < n; ++l) narrow<scalar_t, acc_t>(g[k][l], dst + l * block.lane_stride);
  }
}

// The blocks compiled wide for the dtypes summed in float (one call per block: the clones inline the body).
#define LIT_AMP_DET_WIDE_BLOCKS(suffix, scalar_t)                                                        \
  LIT_MULTIVERSION void tile_block2_##suffix(const TileBlock<scalar_t>& b, int64_t nr, int64_t n) {     \
    tile_block<2>(b, nr, n);                                                                             \
  }                                                                                                      \
  LIT_MULTIVERSION void tile_block4_##suffix(const TileBlock<scalar_t>& b, int64_t nr, int64_t n) {     \
    tile_block<4>(b, nr, n);                                                                             \
  }                                                                                                      \
  LIT_MULTIVERSION void gradient_block2_##suffix(const GradientBlock<scalar_t>& b, int64_t n) {         \
    gradient_block<2>(b, n);                                                                             \
  }                                                                                                      \
  LIT_MULTIVERSION void gradient_block4_##suffix(const GradientBlock<scalar_t>& b, int64_t n) {         \
    gradient_block<4>(b, n);                                                                             \
  }
LIT_AMP_DET_WIDE_BLOCKS(float, float)
LIT_AMP_DET_WIDE_BLOCKS(bf16, c10::BFloat16)
LIT_AMP_DET_WIDE_BLOCKS(half, c10::Half)
#undef LIT_AMP_DET_WIDE_BLOCKS

#define LIT_AMP_DET_RUN_BLOCK(kind, m, ...)                           \
  if constexpr (std::is_same_v<scalar_t, float>) {                   \
    kind##_block##m##_float(__VA_ARGS__);                             \
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {    \
    kind##_block##m##_bf16(__VA_ARGS__);                              \
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {        \
    kind##_block##m##_half(__VA_ARGS__);                              \
  } else { /* double (gradcheck): the baseline template */            \
    kind##_block<m>(__VA_ARGS__);                                     \
  }

template <typename scalar_t>
void run_tile_block(int64_t m, const TileBlock<scalar_t>& block, int64_t nr, int64_t n) {
  if (m == 2) {
    LIT_AMP_DET_RUN_BLOCK(tile, 2, block, nr, n)
  } else {
    LIT_AMP_DET_RUN_BLOCK(tile, 4, block, nr, n)
  }
}

template <typename scalar_t>
void run_gradient_block(int64_t m, const GradientBlock<scalar_t>& block, int64_t n) {
  if (m == 2) {
    LIT_AMP_DET_RUN_BLOCK(gradient, 2, block, n)
  } else {
    LIT_AMP_DET_RUN_BLOCK(gradient, 4, block, n)
  }
}
#undef LIT_AMP_DET_RUN_BLOCK

// Rows (or blocks of rows) per task of at::parallel_for, of `filters` filters each: about 16 K filters a task.
int64_t row_grain(int64_t filters) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(filters, 1));
}

int64_t positions_side(const at::Tensor& tiles, const char* op, const char* name) {
  const int64_t positions = tiles.dim() == 3 ? tiles.size(0) : -1;
  TORCH_CHECK(positions == 16 || positions == 36, op, ": ", name, " must be [16, ...] (F(2x2, 3x3)) or [36, ...] ",
              "(F(4x4, 3x3)), got ", tiles.sizes());
  return positions == 16 ? 2 : 4;
}

void check_weight(const at::Tensor& weight, const char* op, const char* name) {
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == 3 && weight.size(3) == 3, op, ": ", name,
              " must be [C_out, C_in, 3, 3], got ", weight.sizes());
  TORCH_CHECK(at::isFloatingType(weight.scalar_type()), op, ": ", name, " must be floating point, got ",
              weight.scalar_type());
}

// --------------------------------------------------------------------------------------------- ops

void winograd_weight_tiles_kernel(at::Tensor& tiles, const at::Tensor& weight, bool transposed) {
  constexpr const char* op = "winograd_weight_tiles_";
  check_weight(weight, op, "weight");
  const int64_t m = positions_side(tiles, op, "tiles");
  const int64_t c_out = weight.size(0), c_in = weight.size(1);
  const int64_t rows = transposed ? c_out : c_in, columns = transposed ? c_in : c_out;
  TORCH_CHECK(tiles.size(1) == rows && tiles.size(2) == columns && tiles.is_contiguous(), op,
              ": tiles must be a contiguous [", tiles.size(0), ", ", rows, ", ", columns, "] tensor (", 
              transposed ? "[positions, C_out, C_in] for transposed=True" : "[positions, C_in, C_out]", "), got ",
              tiles.sizes());
  TORCH_CHECK(tiles.scalar_type() == weight.scalar_type(), op, ": tiles are ", tiles.scalar_type(),
              " but the weight is ", weight.scalar_type());
  if (rows == 0 || columns == 0) return;
  // transposed: row = output channel, column = input channel, taps of the rotated filter
  const int64_t row_stride = transposed ? weight.stride(0) : weight.stride(1);
  const int64_t lane_stride = transposed ? weight.stride(1) : weight.stride(0);
  int64_t taps[9];
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 3; ++j) {
      const int64_t y = transposed ? 2 - i : i, x = transposed ? 2 - j : j;
      taps[3 * i + j] = y * weight.stride(2) + x * weight.stride(3);
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), op, [&] {
    const scalar_t* src = weight.const_data_ptr<scalar_t>();
    scalar_t* dst = tiles.mutable_data_ptr<scalar_t>();
    const int64_t plane = rows * columns;
    const int64_t row_blocks = (rows + kRows - 1) / kRows;
    at::parallel_for(0, row_blocks, row_grain(columns * kRows), [&](int64_t begin, int64_t end) {
      for (int64_t rb = begin; rb < end; ++rb) {
        const int64_t r = rb * kRows, nr = std::min(kRows, rows - r);
        for (int64_t c0 = 0; c0 < columns; c0 += kLanes) {
          const TileBlock<scalar_t> block{src + r * row_stride + c0 * lane_stride, row_stride, lane_stride, taps,
                                          dst + r * columns + c0, plane, columns};
          run_tile_block<scalar_t>(m, block, nr, std::min(kLanes, columns - c0));
        }
      }
    });
  });
}

void winograd_weight_gradient_kernel(at::Tensor& grad_weight, const at::Tensor& products) {
  constexpr const char* op = "winograd_weight_gradient_";
  check_weight(grad_weight, op, "grad_weight");
  const int64_t m = positions_side(products, op, "products");
  const int64_t c_out = grad_weight.size(0), c_in = grad_weight.size(1);
  TORCH_CHECK(products.size(1) == c_out && products.size(2) == c_in && products.is_contiguous(), op,
              ": products must be a contiguous [", products.size(0), ", ", c_out, ", ", c_in, "] tensor, got ",
              products.sizes());
  const auto acc = grad_weight.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(products.scalar_type() == acc, op, ": products must be ", acc, " (what a ", grad_weight.scalar_type(),
              " gradient is summed in), got ", products.scalar_type());
  if (c_out == 0 || c_in == 0) return;
  int64_t taps[9];
  for (int k = 0; k < 9; ++k) taps[k] = (k / 3) * grad_weight.stride(2) + (k % 3) * grad_weight.stride(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_weight.scalar_type(), op, [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t* src = products.const_data_ptr<acc_t>();
    scalar_t* dst = grad_weight.mutable_data_ptr<scalar_t>();
    const int64_t plane = c_out * c_in, row_stride = grad_weight.stride(0), lane_stride = grad_weight.stride(1);
    at::parallel_for(0, c_out, row_grain(c_in), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t c0 = 0; c0 < c_in; c0 += kLanes) {
          const GradientBlock<scalar_t> block{src + r * c_in + c0, plane, dst + r * row_stride + c0 * lane_stride,
                                              lane_stride, taps};
          run_gradient_block<scalar_t>(m, block, std::min(kLanes, c_in - c0));
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(lit_amp_det, CPU, m) {
  m.impl(TORCH_SELECTIVE_NAME("lit_amp_det::winograd_weight_tiles_"), TORCH_FN(winograd_weight_tiles_kernel));
  m.impl(TORCH_SELECTIVE_NAME("lit_amp_det::winograd_weight_gradient_"), TORCH_FN(winograd_weight_gradient_kernel));
}

}  // namespace ops
}  // namespace lit_amp_det
