// CPU kernels of the Winograd F(2x2, 3x3) and F(4x4, 3x3) tile transforms (semantics: csrc/README.md).
//
// With m x m output tiles (m = 2 or 4, alpha = m + 2 transform positions a side), tile (n, i, j) of a [N, C, H, W]
// map covers output pixels (m*i .. m*i+m-1, m*j .. m*j+m-1); there are T = N * ceil(H/m) * ceil(W/m) tiles, in
// (n, i, j) order, and every op reads or writes [alpha^2, T, C] tiles (16 or 36 positions: the first dimension
// says which algorithm) with C contiguous, so the per-position matrix products are plain [T, C] rows. Each task of
// at::parallel_for walks its tiles one channel chunk at a time: the chunk's pixel vectors are widened into an L1
// buffer, the transform runs there in the accumulation type (float for float/half/bfloat16, double for double),
// and the results are narrowed into the destination. Feature maps are read and written channels_last.
//
//   input tiles   U = B^T d B    d: the alpha x alpha input tile at rows m*i-1 .. m*i+m (zero outside the map)
//   gradient      V = G' g G'^T  g: the m x m output-gradient tile at rows m*i .. m*i+m-1 (zero outside)
//   output        y = A^T M A    M: the alpha^2 products of a tile, y: its m x m output pixels (those inside the map)
//
// Each op writes a range of tiles into a given tensor, so a convolution can run in chunks of tiles through buffers
// that are reused from call to call.
//
// F(2x2, 3x3): B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]   A^T = [1 1 1 0; 0 1 -1 -1]
//              G' = [1 0; .5 .5; .5 -.5; 0 -1]
// F(4x4, 3x3) (points 0, 1, -1, 2, -2, infinity; Lavin & Gray's matrices):
//   B^T = [4 0 -5 0 1 0; 0 -4 -4 1 1 0; 0 4 -4 -1 1 0; 0 -2 -1 2 1 0; 0 2 -1 -2 1 0; 0 4 0 -5 0 1]
//   A^T = [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 0; 0 1 -1 8 -8 1]
//   G' = [1/4 0 0 0; -1/6 -1/6 -1/6 -1/6; -1/6 1/6 -1/6 1/6; 1/24 1/12 1/6 1/3; 1/24 -1/12 1/6 -1/3; 0 0 0 1]
//   (G' evaluates the 4x4 gradient tile as G evaluates a 3x3 filter: the weight gradient is F(3x3, 4x4) on the
//   same input tiles.)
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bf16_bits.h"
#include "multiversion.h"

#include <emmintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <type_traits>

namespace lit_amp_det {
namespace ops {

namespace {

constexpr int64_t kChunk = 256;  // channels per pass: 16 vectors of 256 fp32 = 16 KB in, 16 KB out (F(2x2))
constexpr int64_t kTileGrain = 8;  // tiles per task of at::parallel_for

// Channels per pass of an m x m output tile's transform: F(4x4)'s 36 vectors of 64 fp32 are 9 KB in and 9 KB out.
template <int m>
constexpr int64_t chunk_of() {
  return m == 2 ? kChunk : 64;
}

struct TileGrid {
  int64_t batch, channels, height, width, tiles_h, tiles_w;
  int64_t tiles() const { return batch * tiles_h * tiles_w; }
};

TileGrid grid_of(int64_t batch, int64_t channels, int64_t height, int64_t width, int64_t m) {
  return {batch, channels, height, width, (height + m - 1) / m, (width + m - 1) / m};
}

// --------------------------------------------------------------------------------------------- transforms
// F(2x2, 3x3): each runs over n <= kChunk channels of one tile; in/out hold one kChunk-strided vector per tile
// position.

template <typename acc_t>
__attribute__((always_inline)) inline void input_transform(const acc_t* d, acc_t* u, int64_t n) {
  acc_t t[16][kChunk];
  for (int s = 0; s < 4; ++s) {  // rows: t = B^T d
    const acc_t *d0 = d + (0 + s) * kChunk, *d1 = d + (4 + s) * kChunk, *d2 = d + (8 + s) * kChunk,
                *d3 = d + (12 + s) * kChunk;
    for (int64_t c = 0; c < n; ++c) {
      t[0 + s][c] = d0[c] - d2[c];
      t[4 + s][c] = d1[c] + d2[c];
      t[8 + s][c] = d2[c] - d1[c];
      t[12 + s][c] = d1[c] - d3[c];
    }
  }
  for (int r = 0; r < 4; ++r) {  // columns: u = t B
    const acc_t *t0 = t[4 * r], *t1 = t[4 * r + 1], *t2 = t[4 * r + 2], *t3 = t[4 * r + 3];
    acc_t* o = u + 4 * r * kChunk;
    for (int64_t c = 0; c < n; ++c) {
      o[c] = t0[c] - t2[c];
      o[kChunk + c] = t1[c] + t2[c];
      o[2 * kChunk + c] = t2[c] - t1[c];
      o[3 * kChunk + c] = t1[c] - t3[c];
    }
  }
}

template <typename acc_t>
__attribute__((always_inline)) inline void gradient_transform(const acc_t* g, acc_t* v, int64_t n) {
  acc_t h[8][kChunk];  // G2 g: 4 rows of 2
  for (int q = 0; q < 2; ++q) {
    const acc_t *g0 = g + q * kChunk, *g1 = g + (2 + q) * kChunk;
    for (int64_t c = 0; c < n; ++c) {
      h[0 + q][c] = g0[c];
      h[2 + q][c] = acc_t(0.5) * (g0[c] + g1[c]);
      h[4 + q][c] = acc_t(0.5) * (g0[c] - g1[c]);
      h[6 + q][c] = -g1[c];
    }
  }
  for (int r = 0; r < 4; ++r) {  // (G2 g) G2^T
    const acc_t *h0 = h[2 * r], *h1 = h[2 * r + 1];
    acc_t* o = v + 4 * r * kChunk;
    for (int64_t c = 0; c < n; ++c) {
      o[c] = h0[c];
      o[kChunk + c] = acc_t(0.5) * (h0[c] + h1[c]);
      o[2 * kChunk + c] = acc_t(0.5) * (h0[c] - h1[c]);
      o[3 * kChunk + c] = -h1[c];
    }
  }
}

template <typename acc_t>
__attribute__((always_inline)) inline void output_transform(const acc_t* m, acc_t* y, int64_t n) {
  acc_t s[8][kChunk];  // A^T m: 2 rows of 4
  for (int b = 0; b < 4; ++b) {
    const acc_t *m0 = m + b * kChunk, *m1 = m + (4 + b) * kChunk, *m2 = m + (8 + b) * kChunk,
                *m3 = m + (12 + b) * kChunk;
    for (int64_t c = 0; c < n; ++c) {
      s[b][c] = m0[c] + m1[c] + m2[c];
      s[4 + b][c] = m1[c] - m2[c] - m3[c];
    }
  }
  for (int p = 0; p < 2; ++p) {  // (A^T m) A
    const acc_t *s0 = s[4 * p], *s1 = s[4 * p + 1], *s2 = s[4 * p + 2], *s3 = s[4 * p + 3];
    acc_t* o = y + 2 * p * kChunk;
    for (int64_t c = 0; c < n; ++c) {
      o[c] = s0[c] + s1[c] + s2[c];
      o[kChunk + c] = s1[c] - s2[c] - s3[c];
    }
  }
}

// F(4x4, 3x3): 36 positions; each runs over n <= K channels, one K-strided vector per position.

template <int64_t K, typename acc_t>
__attribute__((always_inline)) inline void input_transform4(const acc_t* d, acc_t* u, int64_t n) {
  acc_t t[36][K];
  for (int s = 0; s < 6; ++s) {  // rows: t = B^T d, column s
    const acc_t *d0 = d + (0 + s) * K, *d1 = d + (6 + s) * K, *d2 = d + (12 + s) * K, *d3 = d + (18 + s) * K,
                *d4 = d + (24 + s) * K, *d5 = d + (30 + s) * K;
    for (int64_t c = 0; c < n; ++c) {
      const acc_t a = d4[c] - acc_t(4) * d2[c], b = d3[c] - acc_t(4) * d1[c];
      const acc_t e = d4[c] - d2[c], f = acc_t(2) * (d3[c] - d1[c]);
      t[0 + s][c] = acc_t(4) * d0[c] - acc_t(5) * d2[c] + d4[c];
      t[6 + s][c] = a + b;
      t[12 + s][c] = a - b;
      t[18 + s][c] = e + f;
      t[24 + s][c] = e - f;
      t[30 + s][c] = acc_t(4) * d1[c] - acc_t(5) * d3[c] + d5[c];
    }
  }
  for (int r = 0; r < 6; ++r) {  // columns: u = t B, row r
    const acc_t *t0 = t[6 * r], *t1 = t[6 * r + 1], *t2 = t[6 * r + 2], *t3 = t[6 * r + 3], *t4 = t[6 * r + 4],
                *t5 = t[6 * r + 5];
    acc_t* o = u + 6 * r * K;
    for (int64_t c = 0; c < n; ++c) {
      const acc_t a = t4[c] - acc_t(4) * t2[c], b = t3[c] - acc_t(4) * t1[c];
      const acc_t e = t4[c] - t2[c], f = acc_t(2) * (t3[c] - t1[c]);
      o[c] = acc_t(4) * t0[c] - acc_t(5) * t2[c] + t4[c];
      o[K + c] = a + b;
      o[2 * K + c] = a - b;
      o[3 * K + c] = e + f;
      o[4 * K + c] = e - f;
      o[5 * K + c] = acc_t(4) * t1[c] - acc_t(5) * t3[c] + t5[c];
    }
  }
}

template <int64_t K, typename acc_t>
__attribute__((always_inline)) inline void gradient_transform4(const acc_t* g, acc_t* v, int64_t n) {
  acc_t h[24][K];  // G' g: 6 rows of 4
  for (int q = 0; q < 4; ++q) {
    const acc_t *g0 = g + q * K, *g1 = g + (4 + q) * K, *g2 = g + (8 + q) * K, *g3 = g + (12 + q) * K;
    for (int64_t c = 0; c < n; ++c) {
      const acc_t even = g0[c] + g2[c], odd = g1[c] + g3[c];
      const acc_t even4 = g0[c] + acc_t(4) * g2[c], odd4 = acc_t(2) * g1[c] + acc_t(8) * g3[c];
      h[0 + q][c] = acc_t(0.25) * g0[c];
      h[4 + q][c] = acc_t(-1.0 / 6) * (even + odd);
      h[8 + q][c] = acc_t(-1.0 / 6) * (even - odd);
      h[12 + q][c] = acc_t(1.0 / 24) * (even4 + odd4);
      h[16 + q][c] = acc_t(1.0 / 24) * (even4 - odd4);
      h[20 + q][c] = g3[c];
    }
  }
  for (int r = 0; r < 6; ++r) {  // (G' g) G'^T
    const acc_t *h0 = h[4 * r], *h1 = h[4 * r + 1], *h2 = h[4 * r + 2], *h3 = h[4 * r + 3];
    acc_t* o = v + 6 * r * K;
    for (int64_t c = 0; c < n; ++c) {
      const acc_t even = h0[c] + h2[c], odd = h1[c] + h3[c];
      const acc_t even4 = h0[c] + acc_t(4) * h2[c], odd4 = acc_t(2) * h1[c] + acc_t(8) * h3[c];
      o[c] = acc_t(0.25) * h0[c];
      o[K + c] = acc_t(-1.0 / 6) * (even + odd);
      o[2 * K + c] = acc_t(-1.0 / 6) * (even - odd);
      o[3 * K + c] = acc_t(1.0 / 24) * (even4 + odd4);
      o[4 * K + c] = acc_t(1.0 / 24) * (even4 - odd4);
      o[5 * K + c] = h3[c];
    }
  }
}

template <int64_t K, typename acc_t>
__attribute__((always_inline)) inline void output_transform4(const acc_t* m, acc_t* y, int64_t n) {
  acc_t s[24][K];  // A^T M: 4 rows of 6
  for (int b = 0; b < 6; ++b) {
    const acc_t *m0 = m + b * K, *m1 = m + (6 + b) * K, *m2 = m + (12 + b) * K, *m3 = m + (18 + b) * K,
                *m4 = m + (24 + b) * K, *m5 = m + (30 + b) * K;
    for (int64_t c = 0; c < n; ++c) {
      const acc_t sum12 = m1[c] + m2[c], dif12 = m1[c] - m2[c], sum34 = m3[c] + m4[c], dif34 = m3[c] - m4[c];
      s[b][c] = m0[c] + sum12 + sum34;
      s[6 + b][c] = dif12 + acc_t(2) * dif34;
      s[12 + b][c] = sum12 + acc_t(4) * sum34;
      s[18 + b][c] = dif12 + acc_t(8) * dif34 + m5[c];
    }
  }
  for (int p = 0; p < 4; ++p) {  // (A^T M) A
    const acc_t *s0 = s[6 * p], *s1 = s[6 * p + 1], *s2 = s[6 * p + 2], *s3 = s[6 * p + 3], *s4 = s[6 * p + 4],
                *s5 = s[6 * p + 5];
    acc_t* o = y + 4 * p * K;
    for (int64_t c = 0; c < n; ++c) {
      const acc_t sum12 = s1[c] + s2[c], dif12 = s1[c] - s2[c], sum34 = s3[c] + s4[c], dif34 = s3[c] - s4[c];
      o[c] = s0[c] + sum12 + sum34;
      o[K + c] = dif12 + acc_t(2) * dif34;
      o[2 * K + c] = sum12 + acc_t(4) * sum34;
      o[3 * K + c] = dif12 + acc_t(8) * dif34 + s5[c];
    }
  }
}

// --------------------------------------------------------------------------------------------- one tile

// Loads n channels from each of `count` pixel vectors (nullptr: zeros) into K-strided rows of `rows`.
template <int64_t K, typename scalar_t, typename acc_t>
__attribute__((always_inline)) inline void load_rows(const scalar_t* const* src, int count, acc_t* rows, int64_t n) {
  for (int k = 0; k < count; ++k, rows += K) {
    const scalar_t* p = src[k];
    if (p == nullptr) {
      for (int64_t c = 0; c < n; ++c) rows[c] = acc_t(0);
    } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      const auto* bits = reinterpret_cast<const uint16_t*>(p);
      for (int64_t c = 0; c < n; ++c) rows[c] = bf16_bits_to_float(bits[c]);
    } else {
      for (int64_t c = 0; c < n; ++c) rows[c] = static_cast<acc_t>(p[c]);
    }
  }
}

// Copies n values to dst with non-temporal (cache-bypassing) stores where dst is 16-byte aligned and n a multiple of
// 8: the tiles are 4x the size of the map they come from and are next read by a matrix product, so a normal store's
// read of each destination line first (write-allocate) would only cost memory bandwidth.
__attribute__((always_inline)) inline void stream_out(const uint16_t* src, uint16_t* dst, int64_t n) {
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || n % 8 != 0) {
    std::memcpy(dst, src, n * sizeof(uint16_t));
    return;
  }
  for (int64_t c = 0; c < n; c += 8) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + c), _mm_load_si128(reinterpret_cast<const __m128i*>(src + c)));
  }
}

// Stores n channels of each of `count` K-strided rows to its destination (nullptr: skipped), plus `bias` when given;
// bf16 tiles (`stream`) bypass the caches.
template <bool stream, int64_t K, typename scalar_t, typename acc_t>
__attribute__((always_inline)) inline void store_rows(acc_t* rows, int count, scalar_t* const* dst,
                                                      const scalar_t* bias, int64_t n) {
  for (int k = 0; k < count; ++k, rows += K) {
    scalar_t* p = dst[k];
    if (p == nullptr) continue;
    if (bias != nullptr) {
      for (int64_t c = 0; c < n; ++c) rows[c] += static_cast<acc_t>(bias[c]);
    }
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if constexpr (stream) {
        alignas(64) uint16_t bits[K];
        for (int64_t c = 0; c < n; ++c) bits[c] = float_to_bf16_bits(rows[c]);
        stream_out(bits, reinterpret_cast<uint16_t*>(p), n);
      } else {
        auto* bits = reinterpret_cast<uint16_t*>(p);
        for (int64_t c = 0; c < n; ++c) bits[c] = float_to_bf16_bits(rows[c]);
      }
    } else {
      for (int64_t c = 0; c < n; ++c) p[c] = static_cast<scalar_t>(rows[c]);
    }
  }
}

enum class Transform { kInput, kGradient, kOutput };

// Pixel vectors a transform reads and writes per tile, for m x m output tiles: alpha^2 tile positions, m^2 output
// or gradient pixels.
template <Transform kind, int m>
constexpr int in_count() {
  return kind == Transform::kGradient ? m * m : (m + 2) * (m + 2);
}
template <Transform kind, int m>
constexpr int out_count() {
  return kind == Transform::kOutput ? m * m : (m + 2) * (m + 2);
}

// One tile's channel chunk: load, transform in acc_t, store.
template <Transform kind, int m, typename scalar_t>
__attribute__((always_inline)) inline void tile_body(const scalar_t* const* src, scalar_t* const* dst,
                                                     const scalar_t* bias, int64_t n) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t K = chunk_of<m>();
  alignas(64) acc_t in[in_count<kind, m>() * K];
  alignas(64) acc_t out[out_count<kind, m>() * K];
  load_rows<K>(src, in_count<kind, m>(), in, n);
  if constexpr (m == 2) {
    if constexpr (kind == Transform::kInput) {
      input_transform(in, out, n);
    } else if constexpr (kind == Transform::kGradient) {
      gradient_transform(in, out, n);
    } else {
      output_transform(in, out, n);
    }
  } else {
    if constexpr (kind == Transform::kInput) {
      input_transform4<K>(in, out, n);
    } else if constexpr (kind == Transform::kGradient) {
      gradient_transform4<K>(in, out, n);
    } else {
      output_transform4<K>(in, out, n);
    }
  }
  store_rows<kind != Transform::kOutput, K>(out, out_count<kind, m>(), dst, bias, n);
}

// tile_body compiled wide for the dtypes summed in float (one call per tile and chunk: the clones inline it).
#define LIT_AMP_DET_WIDE_TILE(name, kind, m, scalar_t)                                                   \
  LIT_MULTIVERSION void name(const scalar_t* const* src, scalar_t* const* dst, const scalar_t* bias, \
                             int64_t n) {                                                               \
    tile_body<kind, m>(src, dst, bias, n);                                                              \
  }
#define LIT_AMP_DET_WIDE_TILES(m)                                                        \
  LIT_AMP_DET_WIDE_TILE(input_tile_bf16_##m, Transform::kInput, m, c10::BFloat16)        \
  LIT_AMP_DET_WIDE_TILE(input_tile_half_##m, Transform::kInput, m, c10::Half)            \
  LIT_AMP_DET_WIDE_TILE(input_tile_float_##m, Transform::kInput, m, float)               \
  LIT_AMP_DET_WIDE_TILE(gradient_tile_bf16_##m, Transform::kGradient, m, c10::BFloat16)  \
  LIT_AMP_DET_WIDE_TILE(gradient_tile_half_##m, Transform::kGradient, m, c10::Half)      \
  LIT_AMP_DET_WIDE_TILE(gradient_tile_float_##m, Transform::kGradient, m, float)         \
  LIT_AMP_DET_WIDE_TILE(output_tile_bf16_##m, Transform::kOutput, m, c10::BFloat16)      \
  LIT_AMP_DET_WIDE_TILE(output_tile_half_##m, Transform::kOutput, m, c10::Half)          \
  LIT_AMP_DET_WIDE_TILE(output_tile_float_##m, Transform::kOutput, m, float)
LIT_AMP_DET_WIDE_TILES(2)
LIT_AMP_DET_WIDE_TILES(4)
#undef LIT_AMP_DET_WIDE_TILES
#undef LIT_AMP_DET_WIDE_TILE

#define LIT_AMP_DET_RUN_TILE(m)                                                                                 \
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {                                                      \
    input ? input_tile_bf16_##m(src, dst, bias, n)                                                              \
          : gradient ? gradient_tile_bf16_##m(src, dst, bias, n) : output_tile_bf16_##m(src, dst, bias, n);     \
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {                                                   \
    input ? input_tile_half_##m(src, dst, bias, n)                                                              \
          : gradient ? gradient_tile_half_##m(src, dst, bias, n) : output_tile_half_##m(src, dst, bias, n);     \
  } else if constexpr (std::is_same_v<scalar_t, float>) {                                                       \
    input ? input_tile_float_##m(src, dst, bias, n)                                                             \
          : gradient ? gradient_tile_float_##m(src, dst, bias, n) : output_tile_float_##m(src, dst, bias, n);   \
  } else { /* double (gradcheck): the baseline template */                                                      \
    tile_body<kind, m>(src, dst, bias, n);                                                                      \
  }

template <Transform kind, int m, typename scalar_t>
void run_tile(const scalar_t* const* src, scalar_t* const* dst, const scalar_t* bias, int64_t n) {
  constexpr bool input = kind == Transform::kInput, gradient = kind == Transform::kGradient;
  if constexpr (m == 2) {
    LIT_AMP_DET_RUN_TILE(2)
  } else {
    LIT_AMP_DET_RUN_TILE(4)
  }
}
#undef LIT_AMP_DET_RUN_TILE

// --------------------------------------------------------------------------------------------- maps

// The pixel vector (y, x) of image n in an NHWC map, or nullptr outside it.
template <typename scalar_t>
inline scalar_t* pixel(scalar_t* map, const TileGrid& g, int64_t n, int64_t y, int64_t x) {
  if (y < 0 || y >= g.height || x < 0 || x >= g.width) return nullptr;
  return map + ((n * g.height + y) * g.width + x) * g.channels;
}

// Reads the side x side pixels of tiles [first, first + count) starting at (m*i + offset, m*j + offset), transforms
// them into the alpha^2 tile positions and writes [alpha^2, count, C]: the input tiles (side alpha, offset -1) and
// the gradient tiles (side m, offset 0).
template <Transform kind, int m, typename scalar_t>
void tiles_kernel(const scalar_t* map, scalar_t* tiles, const TileGrid& g, int64_t first, int64_t count) {
  constexpr int side = kind == Transform::kInput ? m + 2 : m, offset = kind == Transform::kInput ? -1 : 0;
  constexpr int positions = (m + 2) * (m + 2);
  constexpr int64_t K = chunk_of<m>();
  const int64_t per_image = g.tiles_h * g.tiles_w;
  at::parallel_for(0, count, kTileGrain, [&](int64_t begin, int64_t end) {
    const scalar_t* src[side * side];
    scalar_t* dst[positions];
    for (int64_t k = begin; k < end; ++k) {
      const int64_t t = first + k, n = t / per_image, i = (t / g.tiles_w) % g.tiles_h, j = t % g.tiles_w;
      for (int r = 0; r < side; ++r) {
        for (int s = 0; s < side; ++s) src[r * side + s] = pixel(map, g, n, m * i + r + offset, m * j + s + offset);
      }
      for (int p = 0; p < positions; ++p) dst[p] = tiles + (p * count + k) * g.channels;
      for (int64_t c0 = 0; c0 < g.channels; c0 += K) {
        run_tile<kind, m>(src, dst, static_cast<const scalar_t*>(nullptr), std::min(K, g.channels - c0));
        for (auto& p : src) p = p != nullptr ? p + K : nullptr;
        for (auto& p : dst) p += K;
      }
    }
    _mm_sfence();  // the streamed stores are visible before the op returns
  });
}

// Writes the output pixels of tiles [first, first + count) from their products [alpha^2, count, C].
template <int m, typename scalar_t>
void output_kernel(const scalar_t* products, const scalar_t* bias, scalar_t* map, const TileGrid& g, int64_t first,
                   int64_t count) {
  constexpr int positions = (m + 2) * (m + 2);
  constexpr int64_t K = chunk_of<m>();
  const int64_t per_image = g.tiles_h * g.tiles_w;
  at::parallel_for(0, count, kTileGrain, [&](int64_t begin, int64_t end) {
    const scalar_t* src[positions];
    scalar_t* dst[m * m];
    for (int64_t k = begin; k < end; ++k) {
      const int64_t t = first + k, n = t / per_image, i = (t / g.tiles_w) % g.tiles_h, j = t % g.tiles_w;
      for (int p = 0; p < positions; ++p) src[p] = products + (p * count + k) * g.channels;
      for (int p = 0; p < m * m; ++p) dst[p] = pixel(map, g, n, m * i + p / m, m * j + p % m);
      for (int64_t c0 = 0; c0 < g.channels; c0 += K) {
        run_tile<Transform::kOutput, m>(src, dst, bias != nullptr ? bias + c0 : nullptr, std::min(K, g.channels - c0));
        for (auto& p : src) p += K;
        for (auto& p : dst) p = p != nullptr ? p + K : nullptr;
      }
    }
  });
}

// --------------------------------------------------------------------------------------------- ops

void check_map(const at::Tensor& map, const char* op, const char* name) {
  TORCH_CHECK(map.dim() == 4, op, ": ", name, " must be [N, C, H, W], got ", map.dim(), " dimensions");
  TORCH_CHECK(at::isFloatingType(map.scalar_type()), op, ": ", name, " must be floating point, got ",
              map.scalar_type());
}

// The output tile side m of tiles with `positions` transform positions: 16 -> F(2x2, 3x3), 36 -> F(4x4, 3x3).
int64_t output_tile_of(const at::Tensor& tiles, const char* op, const char* name) {
  const int64_t positions = tiles.dim() == 3 ? tiles.size(0) : -1;
  TORCH_CHECK(positions == 16 || positions == 36, op, ": ", name, " must be [16, T, C] (F(2x2, 3x3)) or [36, T, C] ",
              "(F(4x4, 3x3)), got ", tiles.sizes());
  return positions == 16 ? 2 : 4;
}

// (first, count) of the tiles [tile_begin, tile_end), checked against the map's tile count.
std::pair<int64_t, int64_t> tile_range(const TileGrid& g, int64_t tile_begin, int64_t tile_end, const char* op) {
  TORCH_CHECK(0 <= tile_begin && tile_begin <= tile_end && tile_end <= g.tiles(), op, ": tiles [", tile_begin, ", ",
              tile_end, ") are not a range of the map's ", g.tiles(), " tiles");
  return {tile_begin, tile_end - tile_begin};
}

void tiles_into(at::Tensor& tiles, const at::Tensor& map, int64_t tile_begin, bool input_side, const char* op) {
  check_map(map, op, input_side ? "input" : "grad_output");
  const int64_t m = output_tile_of(tiles, op, "tiles");
  const auto g = grid_of(map.size(0), map.size(1), map.size(2), map.size(3), m);
  TORCH_CHECK(tiles.size(2) == g.channels && tiles.is_contiguous(), op, ": tiles must be a contiguous [",
              tiles.size(0), ", T, ", g.channels, "] tensor, got ", tiles.sizes());
  TORCH_CHECK(tiles.scalar_type() == map.scalar_type(), op, ": tiles are ", tiles.scalar_type(), " but the map is ",
              map.scalar_type());
  const auto [first, count] = tile_range(g, tile_begin, tile_begin + tiles.size(1), op);
  if (count == 0 || g.channels == 0) return;
  const at::Tensor nhwc = map.contiguous(at::MemoryFormat::ChannelsLast);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, map.scalar_type(), "winograd_tiles", [&] {
    const scalar_t* src = nhwc.const_data_ptr<scalar_t>();
    scalar_t* dst = tiles.mutable_data_ptr<scalar_t>();
    if (input_side) {
      m == 2 ? tiles_kernel<Transform::kInput, 2>(src, dst, g, first, count)
             : tiles_kernel<Transform::kInput, 4>(src, dst, g, first, count);
    } else {
      m == 2 ? tiles_kernel<Transform::kGradient, 2>(src, dst, g, first, count)
             : tiles_kernel<Transform::kGradient, 4>(src, dst, g, first, count);
    }
  });
}

void winograd_input_tiles_kernel(at::Tensor& tiles, const at::Tensor& input, int64_t tile_begin) {
  tiles_into(tiles, input, tile_begin, true, "winograd_input_tiles_");
}

void winograd_gradient_tiles_kernel(at::Tensor& tiles, const at::Tensor& grad_output, int64_t tile_begin) {
  tiles_into(tiles, grad_output, tile_begin, false, "winograd_gradient_tiles_");
}

void winograd_output_kernel(at::Tensor& out, const at::Tensor& products, const std::optional<at::Tensor>& bias,
                            int64_t tile_begin) {
  check_map(out, "winograd_output_", "out");
  TORCH_CHECK(out.is_contiguous(at::MemoryFormat::ChannelsLast), "winograd_output_: out must be channels_last");
  const int64_t m = output_tile_of(products, "winograd_output_", "products");
  const auto g = grid_of(out.size(0), out.size(1), out.size(2), out.size(3), m);
  TORCH_CHECK(products.size(2) == g.channels, "winograd_output_: products must be [", products.size(0), ", T, ",
              g.channels, "], got ", products.sizes());
  TORCH_CHECK(products.scalar_type() == out.scalar_type(), "winograd_output_: products are ", products.scalar_type(),
              " but out is ", out.scalar_type());
  const auto [first, count] = tile_range(g, tile_begin, tile_begin + products.size(1), "winograd_output_");
  at::Tensor bias_vector;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == g.channels, "winograd_output_: bias must be [", g.channels,
                "], got ", bias->sizes());
    bias_vector = bias->to(products.scalar_type()).contiguous();
  }
  if (count == 0 || g.channels == 0) return;
  const at::Tensor rows = products.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, products.scalar_type(), "winograd_output_", [&] {
    const scalar_t* src = rows.const_data_ptr<scalar_t>();
    const scalar_t* bias_data = bias_vector.defined() ? bias_vector.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    m == 2 ? output_kernel<2, scalar_t>(src, bias_data, dst, g, first, count)
           : output_kernel<4, scalar_t>(src, bias_data, dst, g, first, count);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(lit_amp_det, CPU, m) {
  m.impl(TORCH_SELECTIVE_NAME("lit_amp_det::winograd_input_tiles_"), TORCH_FN(winograd_input_tiles_kernel));
  m.impl(TORCH_SELECTIVE_NAME("lit_amp_det::winograd_gradient_tiles_"), TORCH_FN(winograd_gradient_tiles_kernel));
  m.impl(TORCH_SELECTIVE_NAME("lit_amp_det::winograd_output_"), TORCH_FN(winograd_output_kernel));
}

}  // namespace ops
}  // namespace lit_amp_det
