"""The Triton kernels that :mod:`lit_amp_det.ops` runs on CUDA tensors (private: call :mod:`lit_amp_det.ops`).

``_kernels`` holds the ``@triton.jit`` kernels, ``_launch`` the launchers (input checks, outputs, blocks,
launch; CPU tensors run through Triton's interpreter under ``TRITON_INTERPRET=1``, which the tests use) and
``_register`` fills the CUDA dispatch key of ``torch.ops.lit_amp_det`` with them, so ``lit_amp_det.ops`` on
CUDA tensors runs these kernels with the ops' fake kernels and autograd formulas. Importing this package
imports neither triton nor the kernels.
"""
