// Schemas of lit_amp_det::master_sgd_step_ and lit_amp_det::all_finite (semantics: csrc/README.md).
//
// The optimizer step of the low-precision-weights mode in one pass over memory: the bf16/fp16 gradient is read
// as it is, the fp32 master and its momentum are updated, and the low-precision weight is written from the
// new master. The unfused step moves every value through three passes (gradient -> fp32 master gradient, the
// SGD kernel, master -> weight) and keeps an fp32 gradient per parameter. all_finite is the step's non-finite
// check in one read of the gradients, a 0-dim bool tensor. Neither is differentiable.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(lit_amp_det, m) {
  m.def(
      "master_sgd_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
      "Tensor(c!)[] low_weights, float lr, float momentum, float dampening, float weight_decay, bool nesterov, "
      "bool maximize, float grad_scale, bool first_step) -> ()");
  m.def("all_finite(Tensor[] tensors) -> Tensor");
}
