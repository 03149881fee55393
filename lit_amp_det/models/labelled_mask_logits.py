"""The mask head's logits of each positive RoI's own class only, for the training loss.

torchvision's ``MaskRCNNPredictor`` ends in a 1x1 convolution to ``num_classes`` logit maps, ``[K, num_classes,
28, 28]``, and ``maskrcnn_loss`` then keeps one map per RoI, its ground-truth class's, and drops the rest. Under
mixed precision all of them are cast to fp32 first (the predictor's fp32 region), and the backward writes
zeros into the dropped maps, casts them back and runs the full convolution's backward. Computing only the kept
map is one dot product of each RoI's 256-channel features with its class's weight row: ``num_classes`` times
fewer FLOPs for that layer, no ``[K, num_classes, 28, 28]`` tensor in either direction, and the same gradients
(a dropped map's gradient is zero, so its weight rows get none either way). The sums run in another order
than the convolution's, so results agree to rounding, not bit for bit.

Used by :class:`lit_amp_det.models.ext_ops.ExtRoIHeads` when ``labelled_mask_logits`` is on
(``model.labelled_mask_logits=true``), for predictors shaped like torchvision's (anything else falls back to the
full logits). Inference still computes every class's map: the labels are not known before the box head.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["labelled_logits", "logit_conv"]


def logit_conv(predictor: nn.Module) -> nn.Conv2d | None:
    """The final 1x1 convolution of a torchvision-style ``MaskRCNNPredictor``, or None if ``predictor`` is not one.

    Its shape: an ``nn.Sequential`` (with Sequential's own forward) of upsampling, ReLU and a 1x1, stride-1,
    unpadded, ungrouped ``Conv2d`` named ``mask_fcn_logits``. A forward replaced on the instance disqualifies it,
    except an ``fp32_outputs`` precision region (whose fp32 cast the labelled loss makes itself).
    """
    if not isinstance(predictor, nn.Sequential) or type(predictor).forward is not nn.Sequential.forward:
        return None
    own_forward = vars(predictor).get("forward")  # set on the instance: a precision region, or a user's patch
    if own_forward is not None and getattr(own_forward, "mode", None) != "fp32_outputs":
        return None  # only an fp32_outputs region is reproduced (the loss reads the logits in fp32); an fp32 one
        # asks for the convolution itself in fp32, which the full path does
    conv = getattr(predictor, "mask_fcn_logits", None)
    if not (isinstance(conv, nn.Conv2d) and type(conv).forward is nn.Conv2d.forward and len(predictor) == 3
            and predictor[-1] is conv and conv.kernel_size == (1, 1) and conv.stride == (1, 1)
            and conv.padding == (0, 0) and conv.dilation == (1, 1) and conv.groups == 1):
        return None
    return conv


def labelled_logits(predictor: nn.Module, features: Tensor, labels: Tensor) -> Tensor | None:
    """``predictor(features)[arange(K), labels]`` without the other classes' maps: ``Tensor[K, S, S]``.

    Args:
        predictor: a torchvision-style ``MaskRCNNPredictor`` (:func:`logit_conv`); its upsampling and ReLU run as
            modules (so their hooks run), the last convolution as one batched dot product per RoI.
        features (Tensor[K, C, H, W]): the mask head's output for K positive RoIs.
        labels (Tensor[K], int64): each RoI's class.

    Returns:
        The logits in the dtype the convolution would give (the features' under autocast or half weights), or
        None when ``predictor`` is not torchvision's shape.
    """
    conv = logit_conv(predictor)
    if conv is None:
        return None
    x = predictor[1](predictor[0](features))  # upsampling and ReLU, as the predictor runs them
    k, channels, height, width = x.shape
    weight = conv.weight[labels, :, 0, 0]  # [K, C]: each RoI's class row
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)  # the dtype autocast would give the convolution
        x, weight = x.to(dtype), weight.to(dtype)
    elif weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        pixels = x.permute(0, 2, 3, 1).reshape(k, height * width, channels)  # a view of NHWC memory
        out = torch.bmm(pixels, weight.unsqueeze(-1))
    else:
        out = torch.bmm(weight.unsqueeze(1), x.reshape(k, channels, height * width))
    out = out.reshape(k, height, width)
    if conv.bias is not None:
        out = out + conv.bias[labels].to(out.dtype)[:, None, None]
    return out
