"""A 1x1 convolution on a channels_last feature map, computed as one matrix product.

A 1x1 convolution with no padding and one group is a matrix product over pixels: with the input laid out NHWC,
its ``[N*H*W, C_in]`` rows times the ``[C_in, C_out]`` weight are the output's ``[N*H*W, C_out]`` rows, already in
NHWC order; a stride ``s`` just takes every ``s``-th pixel first. Its backward is two more products (input
gradient ``G @ W``, weight gradient ``G^T @ X``).

Why: on the CPU, oneDNN's bf16 convolution is slow on the backbone's small, deep maps. Measured on the dev CPU
(2-core AMD EPYC, torch 2.14.1, bf16 channels_last, batch 2, forward + backward): ResNet-50 layer4's 2048 -> 512
at 8x8 2.63 vs 0.95 ms as matmuls, 512 -> 2048 1.41 vs 0.92, layer3's 1024 -> 256 at 16x16 1.06 vs 0.92, the
FPN's 2048 -> 256 lateral at 8x8 1.42 vs 0.52, the 1024 -> 2048 stride-2 shortcut 3.41 vs 1.86; on 32x32 and
64x64 maps both take about the same time. End-to-end figures: BENCHMARKS.md.

:class:`_PointwiseConv` writes its products straight into channels_last tensors of their own, so the output is not
a view: the ResNet block's in-place ``out += identity`` and ReLU on it stay plain in-place ops (on a permuted view
autograd would rebuild the base's gradient through copies). The matmul is taken only when the layer computes in
fp16/bf16 on an NHWC input; float32 (where oneDNN's convolution wins) and NCHW inputs run the convolution.

:func:`use_pointwise_matmul` switches the 1x1 convolutions of a detector's backbone (ResNet body and FPN) in place by
changing their class to :class:`PointwiseConv2d`: no parameter, buffer or ``state_dict`` key changes, so
checkpoints load either way, and conv-BN eval (:mod:`lit_amp_det.models.conv_bn`) folds them as before, through
:func:`convolve`. Configured by ``model.pointwise_conv_as_matmul``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_amp_det.models.half_compute import apply_with_autocast_casts, computes_in_half

__all__ = ["PointwiseConv2d", "convolve", "is_pointwise", "pointwise_conv2d", "use_pointwise_matmul"]


def is_pointwise(conv: nn.Conv2d) -> bool:
    """True for a 1x1 ``Conv2d`` without padding and with one group (any stride): the layers computed as a matmul."""
    return (tuple(conv.kernel_size) == (1, 1) and conv.padding in ((0, 0), "valid") and conv.groups == 1)


def _is_nhwc(x: Tensor) -> bool:
    """Whether ``x`` (4-D) is laid out NHWC with no gaps, so that its pixels are the rows of a ``[N*H*W, C]`` view."""
    return x.permute(0, 2, 3, 1).is_contiguous()


def _pixel_rows(x: Tensor, stride: tuple[int, int]) -> Tensor:
    """The ``[N*H_out*W_out, C]`` pixel rows a 1x1 convolution of stride ``stride`` reads from NHWC ``x``: a view for
    stride 1, a compact copy of every ``stride``-th pixel otherwise."""
    pixels = x[:, :, ::stride[0], ::stride[1]].permute(0, 2, 3, 1)
    return pixels.reshape(-1, x.shape[1])


class _PointwiseConv(torch.autograd.Function):
    """``F.conv2d(x, weight, bias, stride)`` for a 1x1 ``weight`` and an NHWC ``x``: one matrix product written into a
    channels_last output of its own (not a view), and two in the backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, stride: tuple[int, int]) -> Tensor:
        n, c_in, height, width = x.shape
        c_out = weight.shape[0]
        out_h, out_w = (height - 1) // stride[0] + 1, (width - 1) // stride[1] + 1
        matrix = weight.reshape(c_out, c_in)
        out = torch.empty((n, c_out, out_h, out_w), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
        out_rows = out.permute(0, 2, 3, 1).view(-1, c_out)
        rows = _pixel_rows(x, stride)
        if bias is None:
            torch.mm(rows, matrix.t(), out=out_rows)
        else:
            torch.addmm(bias, rows, matrix.t(), out=out_rows)
        ctx.save_for_backward(x, weight)
        ctx.stride, ctx.has_bias = stride, bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        x, weight = ctx.saved_tensors
        stride = ctx.stride
        c_out, c_in = weight.shape[:2]
        n, _, out_h, out_w = grad.shape
        grad_rows = grad.permute(0, 2, 3, 1).reshape(-1, c_out)  # a view for a channels_last gradient
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            matrix = weight.reshape(c_out, c_in)
            if stride != (1, 1):  # only every stride-th pixel was read: the others get zeros
                grad_x = torch.zeros_like(x, memory_format=torch.channels_last)
                picked = torch.mm(grad_rows, matrix).view(n, out_h, out_w, c_in).permute(0, 3, 1, 2)
                grad_x[:, :, ::stride[0], ::stride[1]] = picked
            elif torch.is_grad_enabled():  # create_graph: differentiable ops only, so double backward works
                grad_x = torch.mm(grad_rows, matrix).view(n, out_h, out_w, c_in).permute(0, 3, 1, 2)
            else:  # a tensor of its own, not a view: autograd may add the shortcut's gradient into it in place
                grad_x = torch.empty_like(x, memory_format=torch.channels_last)
                torch.mm(grad_rows, matrix, out=grad_x.permute(0, 2, 3, 1).view(-1, c_in))
        if ctx.needs_input_grad[1]:
            grad_weight = torch.mm(grad_rows.t(), _pixel_rows(x, stride)).view(weight.shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_rows.sum(0)
        return grad_x, grad_weight, grad_bias, None


def pointwise_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: int | tuple[int, int] = 1) -> Tensor:
    """``F.conv2d(x, weight, bias, stride)`` for a 1x1, ungrouped ``weight`` ``[C_out, C_in, 1, 1]`` and an NHWC
    ``x`` ``[N, C_in, H, W]``, as matrix products (see the module doc). Returns a channels_last tensor of its own.
    Under autocast the operands are cast to the autocast dtype first, as ``F.conv2d`` casts them."""
    if x.dim() != 4 or tuple(weight.shape[2:]) != (1, 1) or weight.shape[1] != x.shape[1]:
        raise ValueError(f"pointwise_conv2d needs x [N, C_in, H, W] and weight [C_out, C_in, 1, 1], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if not _is_nhwc(x):
        raise ValueError("pointwise_conv2d needs a channels_last input (x.contiguous(memory_format=torch.channels_last))")
    strides = (stride, stride) if isinstance(stride, int) else tuple(stride)
    return apply_with_autocast_casts(_PointwiseConv, x, weight, bias, strides)


class PointwiseConv2d(nn.Conv2d):
    """``nn.Conv2d`` that computes a 1x1 layer (:func:`is_pointwise`) on an NHWC input in fp16/bf16 as one matrix
    product; everything else runs ``nn.Conv2d``'s convolution. Same parameters and ``state_dict`` as the layer it
    replaces."""

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 (torch's name)
        return self.convolve(input, self.weight, self.bias)

    def convolve(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # noqa: A002
        """This layer's convolution of ``input`` with another ``weight`` and ``bias`` of the same shapes (conv-BN
        eval's folded ones), as a matmul when :meth:`computes_as_matmul`."""
        if self.computes_as_matmul(input):
            return pointwise_conv2d(input, weight, bias, self.stride)
        return self._conv_forward(input, weight, bias)

    def computes_as_matmul(self, input: Tensor) -> bool:  # noqa: A002 (torch's name)
        """True when ``forward(input)`` takes the matrix product: a batched NHWC input computed in fp16/bf16."""
        return (input.dim() == 4 and is_pointwise(self) and self.padding_mode == "zeros" and _is_nhwc(input)
                and computes_in_half(input))


def convolve(conv: nn.Conv2d, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # noqa: A002
    """``conv``'s convolution of ``input`` with ``weight`` and ``bias`` in place of its own parameters: through the
    layer's own ``convolve`` for a switched layer (:class:`PointwiseConv2d`,
    :class:`~lit_amp_det.models.winograd_conv.WinogradConv2d`), ``F.conv2d`` with ``conv``'s geometry otherwise
    (zero padding)."""
    own = getattr(conv, "convolve", None)
    if own is not None:
        return own(input, weight, bias)
    return F.conv2d(input, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)


def use_pointwise_matmul(detector: nn.Module) -> int:
    """Switches every 1x1 ``nn.Conv2d`` (the exact class, not a subclass, which may have its own ``forward``) of the
    detector's ``backbone`` (ResNet body and FPN) to :class:`PointwiseConv2d`, in place. Returns how many were
    switched. The heads are left alone: their 1x1 layers are a few output channels wide (RPN scores) or have a
    path of their own (the mask logits)."""
    if not hasattr(detector, "backbone"):
        raise TypeError(f"model.pointwise_conv_as_matmul=true needs a detector with a .backbone, got "
                        f"{type(detector).__name__}")
    switched = 0
    for module in detector.backbone.modules():
        if type(module) is nn.Conv2d and is_pointwise(module) and "forward" not in vars(module):
            module.__class__ = PointwiseConv2d
            switched += 1
    return switched
