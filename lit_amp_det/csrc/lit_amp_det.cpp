// Entry point of the compiled extension `lit_amp_det._C`.
//
// The ops register themselves with the dispatcher from static initialisers in ops/*.cpp when the
// shared library is loaded; this file gives Python an importable module (so `import lit_amp_det._C`
// is all it takes, no pybind11) and one query op saying whether CUDA kernels were compiled in.
#include <Python.h>
#include <torch/library.h>

namespace lit_amp_det {
namespace {

// CUDA version the kernels were compiled for (e.g. 13000 for 13.0; setup.py passes it in, from
// torch.version.cuda), or -1 for a CPU-only build. The Python front end asks this before sending a CUDA
// tensor to an op, and falls back instead of failing.
int64_t cuda_version() {
#ifdef WITH_CUDA
  return LIT_AMP_DET_CUDA_VERSION;
#else
  return -1;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lit_amp_det, m) {
  m.def("_cuda_version", &cuda_version);
}

}  // namespace lit_amp_det

extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",
      "lit_amp_det's C++/CUDA detection ops, registered under torch.ops.lit_amp_det",
      -1,  // no per-module state
      nullptr,
  };
  return PyModule_Create(&module_def);
}
}
