"""A transposed convolution whose kernel equals its stride, computed as one matrix product.

Mask R-CNN upsamples every positive RoI's 14x14 mask features to 28x28 with ``ConvTranspose2d(256, 256, 2,
stride=2)`` (torchvision's ``MaskRCNNPredictor.conv5_mask``). When the kernel equals the stride (and padding,
output padding and dilation are the defaults, one group), the output patches do not overlap: output pixel
``(kh * i + a, kw * j + b)`` is input pixel ``(i, j)`` times the weight slice ``W[:, :, a, b]``, plus the bias. So
the whole layer is one ``[N*H*W, C_in] @ [C_in, kh*kw*C_out]`` product followed by one rearrangement of its
output into the image, the "patch" view of a convolution (TVM's rewrites of Mask R-CNN make the same kind of
substitution).

Why: on the CPU oneDNN's bf16 backward of this layer is slow. Measured on the dev CPU (2-core AMD EPYC, torch
2.14.1) for the R50-FPN mask head's shape (70 RoIs, 256 channels, 14x14 -> 28x28), forward + backward:
75.9 ms native vs 37.1 ms as a matmul in bf16 channels_last, 73.9 vs 52.7 ms in bf16 NCHW, with the forward
equal (11.3 vs 11.5 ms channels_last) and the bf16 outputs identical. In float32 it depends on the CPU: on that
AVX-512 CPU MKL's matmul lost to oneDNN's convolution (131 vs 169 ms channels_last), while on an AVX2 CPU (where
``trainer.precision=auto`` trains in fp32) oneDNN's fp32 backward of this layer runs at about 63 GFLOP/s and the
matmul form made the whole fp32 training step faster: 1.04x on the R50-FPN (256 px, batch 2) and 1.035x on the
light model (paired steps in one process). So :class:`PatchConvTranspose2d` takes the matmul when the layer computes
in float16 or bfloat16 (its input's dtype, or the autocast dtype when autocast is on), or in float32 on a CPU whose
capability is in :data:`FP32_MATMUL_CAPABILITIES`, and calls ``nn.ConvTranspose2d.forward`` otherwise. End-to-end
figures: BENCHMARKS.md.

:func:`use_patch_deconv` switches a built model over in place by changing the class of every qualifying
``nn.ConvTranspose2d``: no parameter, buffer or ``state_dict`` key changes, so checkpoints load either way.
Configured by ``model.deconv_as_matmul``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lit_amp_det.models.bounded_matmul import chunked_addmm
from lit_amp_det.models.half_compute import computes_in_half, convolution_dtype
from lit_amp_det.ops.layout import suggest_memory_format

__all__ = ["FP32_MATMUL_CAPABILITIES", "PatchConvTranspose2d", "is_patchwise", "patch_conv_transpose2d",
           "patch_products", "use_patch_deconv"]

#: torch's CPU capabilities (``torch.backends.cpu.get_cpu_capability()``) on which the layer takes the matmul in
#: float32 too: measured faster there (AVX2 AMD EPYC, paired training steps), and slower on the AVX-512 dev CPU.
FP32_MATMUL_CAPABILITIES = frozenset({"AVX2"})


def is_patchwise(layer: nn.ConvTranspose2d) -> bool:
    """True when ``layer``'s output patches do not overlap and it has no padding: kernel == stride, zero padding
    and output padding, dilation 1, one group (the layers :func:`patch_conv_transpose2d` computes)."""
    return (tuple(layer.kernel_size) == tuple(layer.stride) and tuple(layer.padding) == (0, 0)
            and tuple(layer.output_padding) == (0, 0) and tuple(layer.dilation) == (1, 1) and layer.groups == 1)


def _image_as_patches(image: Tensor, kh: int, kw: int) -> Tensor:
    """``[N, C, H*kh, W*kw]`` viewed as ``[N, H, W, kh, kw, C]`` (a view for any strides: dims are only split)."""
    return image.unflatten(2, (-1, kh)).unflatten(4, (-1, kw)).permute(0, 2, 4, 3, 5, 1)


class _PatchesToImage(torch.autograd.Function):
    """``[N*H*W, kh*kw*C]`` matmul output -> a fresh ``[N, C, H*kh, W*kw]`` image in one copy.

    A Function rather than ``permute``/``reshape`` so that the image is a tensor of its own, not a view: the mask
    head applies an in-place ReLU to it, and an in-place op on a view makes autograd rebuild the base's gradient
    through ``as_strided`` (a zero-filled copy of the whole map, three more copies of it, and a strided ReLU
    backward: 44 instead of 8 ms on the R50-FPN mask head, which cancelled the matmul's gain). Its backward is
    :class:`_ImageToPatches`, and vice versa, so higher-order gradients work.
    """

    @staticmethod
    def forward(ctx: Any, patches: Tensor, geometry: tuple[int, ...], memory_format: torch.memory_format) -> Tensor:
        n, height, width, kh, kw, channels = geometry
        image = torch.empty((n, channels, height * kh, width * kw), dtype=patches.dtype, device=patches.device,
                            memory_format=memory_format)
        _image_as_patches(image, kh, kw).copy_(patches.view(geometry))
        ctx.kernel = (kh, kw)
        return image

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _ImageToPatches.apply(grad, *ctx.kernel), None, None


class _ImageToPatches(torch.autograd.Function):
    """The inverse rearrangement: ``[N, C, H*kh, W*kw]`` image -> contiguous ``[N*H*W, kh*kw*C]``."""

    @staticmethod
    def forward(ctx: Any, image: Tensor, kh: int, kw: int) -> Tensor:
        view = _image_as_patches(image, kh, kw)
        patches = image.new_empty(view.shape)
        patches.copy_(view)
        ctx.geometry, ctx.memory_format = tuple(view.shape), suggest_memory_format(image)
        n, height, width, kh, kw, channels = view.shape
        return patches.view(n * height * width, kh * kw * channels)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _PatchesToImage.apply(grad.contiguous(), ctx.geometry, ctx.memory_format), None, None


def patch_products(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The layer's matrix product before the rearrangement: ``Tensor[N*H*W, kh*kw*C_out]``, row ``(n, i, j)``,
    column ``(a, b, o)`` = output pixel ``(kh*i + a, kw*j + b)`` of image ``n``, channel ``o``. Pointwise consumers
    (a ReLU, a 1x1 convolution) can run on it before the pixels are put in image order."""
    n, c_in, height, width = x.shape
    _, c_out, kh, kw = weight.shape
    rows = x.permute(0, 2, 3, 1).reshape(n * height * width, c_in)  # a view for channels_last input
    cols = weight.permute(0, 2, 3, 1).reshape(c_in, kh * kw * c_out)  # column (a, b, o): W[:, o, a, b]
    # in chunks of rows on the CPU in half precision: the row count changes with the RoI count of every step
    return chunked_addmm(rows, cols, None if bias is None else bias.repeat(kh * kw))


def patch_conv_transpose2d(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.conv_transpose2d(x, weight, bias, stride=weight.shape[2:])`` for a batched ``[N, C_in, H, W]`` input, as
    one matrix product (see the module doc). ``weight`` is ``[C_in, C_out, kh, kw]``. The output has the input's
    memory format (channels_last in, channels_last out) and is a tensor of its own (in-place ops on it are cheap)."""
    n, _, height, width = x.shape
    _, c_out, kh, kw = weight.shape
    patches = patch_products(x, weight, bias)
    return _PatchesToImage.apply(patches, (n, height, width, kh, kw, c_out), suggest_memory_format(x))


class PatchConvTranspose2d(nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` that computes a patchwise layer (:func:`is_patchwise`) in fp16/bf16, and in fp32 on a
    CPU of :data:`FP32_MATMUL_CAPABILITIES`, as one matrix product; everything else (float32 elsewhere, float64, an
    explicit ``output_size``, unbatched input, another geometry) runs ``nn.ConvTranspose2d.forward``. Same parameters
    and ``state_dict`` as the layer it replaces."""

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:  # noqa: A002 (torch's name)
        if output_size is None and self.computes_as_matmul(input):
            return patch_conv_transpose2d(input, self.weight, self.bias)
        return super().forward(input, output_size)

    def computes_as_matmul(self, input: Tensor) -> bool:  # noqa: A002 (torch's name)
        """True when ``forward(input)`` takes the matrix product: a batched input computed in fp16/bf16, or in fp32
        on a CPU of :data:`FP32_MATMUL_CAPABILITIES`."""
        return input.dim() == 4 and is_patchwise(self) and (computes_in_half(input) or _fp32_matmul_pays(input))


def _fp32_matmul_pays(x: Tensor) -> bool:
    """Whether ``x`` computes in float32 on a CPU of :data:`FP32_MATMUL_CAPABILITIES` (read at every call, so that a
    test can set the capability)."""
    return (x.device.type == "cpu" and convolution_dtype(x) == torch.float32
            and torch.backends.cpu.get_cpu_capability() in FP32_MATMUL_CAPABILITIES)


def use_patch_deconv(model: nn.Module) -> int:
    """Switches every patchwise ``nn.ConvTranspose2d`` of ``model`` (the exact class, not a subclass, which may
    have its own ``forward``) to :class:`PatchConvTranspose2d`, in place. Returns how many were switched."""
    switched = 0
    for module in model.modules():
        if type(module) is nn.ConvTranspose2d and is_patchwise(module):
            module.__class__ = PatchConvTranspose2d
            switched += 1
    return switched
