// Schemas of the Winograd F(2x2, 3x3) and F(4x4, 3x3) tile transforms (semantics: csrc/README.md); the tiles'
// first dimension (16 or 36 transform positions) selects the algorithm.
//
// A 3x3 convolution with stride 1 and padding 1 computed as 16 matrix products over 4x4 input tiles: 2.25x fewer
// multiplications than the direct convolution (Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks").
// These ops are the memory-bound parts around the products, one pass each over channels_last feature maps and
// weights; the products themselves are torch.bmm
// (lit_amp_det/models/winograd_conv.py composes them into a differentiable convolution). Each writes a range of tiles
// (in (image, tile row, tile column) order) into a given tensor, so a convolution can run in chunks through buffers
// it reuses. Not differentiable.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(lit_amp_det, m) {
  m.def("winograd_input_tiles_(Tensor(a!) tiles, Tensor input, int tile_begin=0) -> ()");
  m.def("winograd_gradient_tiles_(Tensor(a!) tiles, Tensor grad_output, int tile_begin=0) -> ()");
  m.def("winograd_output_(Tensor(a!) out, Tensor products, Tensor? bias, int tile_begin=0) -> ()");
  // The weight transforms: G w G^T of each 3x3 filter into [positions, C_in, C_out] tiles (transposed: of the
  // rotated filters into [positions, C_out, C_in], the input gradient's), and the 3x3 weight gradient A'^T s A' from
  // the [positions, C_out, C_in] sums of products (float32; float64 for a float64 gradient).
  m.def("winograd_weight_tiles_(Tensor(a!) tiles, Tensor weight, bool transposed=False) -> ()");
  m.def("winograd_weight_gradient_(Tensor(a!) grad_weight, Tensor products) -> ()");
}
