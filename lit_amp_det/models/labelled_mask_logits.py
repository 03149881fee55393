"""The mask head's logits of each RoI's own class only: the ones the training loss and inference read.

torchvision's ``MaskRCNNPredictor`` ends in a 1x1 convolution to ``num_classes`` logit maps, ``[K, num_classes,
28, 28]``, and ``maskrcnn_loss`` then keeps one map per RoI, its ground-truth class's, and drops the rest. Under
mixed precision all of them are cast to fp32 first (the predictor's fp32 region), and the backward writes
zeros into the dropped maps, casts them back and runs the full convolution's backward. Computing only the kept
map is one dot product of each RoI's 256-channel features with its class's weight row: ``num_classes`` times
fewer FLOPs for that layer, no ``[K, num_classes, 28, 28]`` tensor in either direction, and the same gradients
(a dropped map's gradient is zero, so its weight rows get none either way). The sums run in another order
than the convolution's, so results agree to rounding, not bit for bit.

With the matmul upsampling (``model.deconv_as_matmul``, :mod:`lit_amp_det.models.patch_deconv`) in fp16/bf16 the
upsampling, its ReLU and the dot product all run on the upsampling's patch-ordered product, so the 28x28
``[K, 256, 28, 28]`` image is never put in pixel order (two copies of the largest tensor of the mask head, forward
and backward): only the ``[K, 28, 28]`` logits are. That path is taken when neither module has hooks.

Used by :class:`lit_amp_det.models.ext_ops.ExtRoIHeads` when ``labelled_mask_logits`` is on
(``model.labelled_mask_logits=true``), for predictors shaped like torchvision's (anything else falls back to the
full logits). At inference it computes each detection's map of its predicted class only: the box head has chosen
the labels before the mask head runs, and torchvision's ``maskrcnn_inference`` keeps that one map of all
``num_classes``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules import module as module_globals

from lit_amp_det.models.bounded_matmul import chunked_bmm
from lit_amp_det.models.half_compute import convolution_dtype
from lit_amp_det.models.patch_deconv import PatchConvTranspose2d, patch_products

__all__ = ["casts_outputs_to_fp32", "labelled_logits", "logit_conv"]


def logit_conv(predictor: nn.Module) -> nn.Conv2d | None:
    """The final 1x1 convolution of a torchvision-style ``MaskRCNNPredictor``, or None if ``predictor`` is not one.

    Its shape: an ``nn.Sequential`` (with Sequential's own forward) of upsampling, ReLU and a 1x1, stride-1,
    unpadded, ungrouped ``Conv2d`` named ``mask_fcn_logits``. A forward replaced on the instance disqualifies it,
    except an ``fp32_outputs`` precision region (whose fp32 cast the labelled loss makes itself).
    """
    if not isinstance(predictor, nn.Sequential) or type(predictor).forward is not nn.Sequential.forward:
        return None
    own_forward = vars(predictor).get("forward")  # set on the instance: a precision region, or a user's patch
    if own_forward is not None and _fp32_outputs_region(predictor) is None:
        return None  # only an fp32_outputs region is reproduced (the loss reads the logits in fp32); an fp32 one
        # asks for the convolution itself in fp32, which the full path does
    conv = getattr(predictor, "mask_fcn_logits", None)
    if not (isinstance(conv, nn.Conv2d) and type(conv).forward is nn.Conv2d.forward and len(predictor) == 3
            and predictor[-1] is conv and conv.kernel_size == (1, 1) and conv.stride == (1, 1)
            and conv.padding == (0, 0) and conv.dilation == (1, 1) and conv.groups == 1):
        return None
    return conv


def _fp32_outputs_region(predictor: nn.Module) -> Any:
    """The precision plugin's ``fp32_outputs`` region wrapped around ``predictor.forward``, or None. Read by its
    ``mode`` and ``in_force()`` (``lit_amp_det.precision.casting``, a layer this one does not import)."""
    region = vars(predictor).get("forward")
    return region if getattr(region, "mode", None) == "fp32_outputs" else None


def casts_outputs_to_fp32(predictor: nn.Module) -> bool:
    """Whether ``predictor``'s forward casts its half outputs to fp32: it is wrapped in an ``fp32_outputs`` precision
    region (the precision plugin's default for the mask predictor) that is in force (mixed precision on for it).
    The loss and the inference that read :func:`labelled_logits` then cast them themselves."""
    in_force = getattr(_fp32_outputs_region(predictor), "in_force", None)
    return callable(in_force) and bool(in_force())


def labelled_logits(predictor: nn.Module, features: Tensor, labels: Tensor) -> Tensor | None:
    """``predictor(features)[arange(K), labels]`` without the other classes' maps: ``Tensor[K, S, S]``.

    Args:
        predictor: a torchvision-style ``MaskRCNNPredictor`` (:func:`logit_conv`). Its upsampling and ReLU run as
            modules, or, for a matmul upsampling in fp16/bf16 and no hooks on either, on the patch-ordered product
            (see the module doc); the last convolution as one batched dot product per RoI.
        features (Tensor[K, C, H, W]): the mask head's output for K positive RoIs.
        labels (Tensor[K], int64): each RoI's class.

    Returns:
        The logits in the dtype the convolution would give (the features' under autocast or half weights), or
        None when ``predictor`` is not torchvision's shape.
    """
    conv = logit_conv(predictor)
    if conv is None:
        return None
    if _takes_patches(predictor, features):
        return _logits_from_patches(predictor, conv, features, labels)
    x = predictor[1](predictor[0](features))  # upsampling and ReLU, as the predictor runs them
    k, channels, height, width = x.shape
    x, weight = _in_compute_dtype(x, conv.weight[labels, :, 0, 0])  # [K, C]: each RoI's class row
    if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        pixels = x.permute(0, 2, 3, 1).reshape(k, height * width, channels)  # a view of NHWC memory
        out = chunked_bmm(pixels, weight.unsqueeze(-1))
    else:
        out = chunked_bmm(weight.unsqueeze(1), x.reshape(k, channels, height * width))
    return _with_bias(out.reshape(k, height, width), conv, labels)


def _in_compute_dtype(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` and the class rows in the dtype the convolution would compute in: autocast's, else ``x``'s."""
    dtype = convolution_dtype(x)
    return x.to(dtype), weight.to(dtype)


#: Attribute (True) of a forward pre-hook that only casts floating inputs to the module's weight dtype: the
#: low-precision-weights mode's hook (``lit_amp_det.precision.master_weights``). The patch path casts like it.
INPUT_CAST_HOOK_FLAG = "casts_inputs_to_weight_dtype"


def _casts_inputs(hook: object) -> bool:
    return getattr(hook, INPUT_CAST_HOOK_FLAG, False) is True


def _hookless(module: nn.Module, *, allow_input_cast: bool = False) -> bool:
    """No forward or backward hooks on ``module`` nor global ones: replacing its call by the same maths is unseen.
    ``allow_input_cast``: except forward pre-hooks that only cast the inputs to the weight dtype (see
    :data:`INPUT_CAST_HOOK_FLAG`), which the caller then applies itself."""
    pre_hooks = [h for h in module._forward_pre_hooks.values() if not (allow_input_cast and _casts_inputs(h))]
    own = (module._forward_hooks, pre_hooks, module._backward_hooks, module._backward_pre_hooks)
    shared = (module_globals._global_forward_hooks, module_globals._global_forward_pre_hooks,
              module_globals._global_backward_hooks, module_globals._global_backward_pre_hooks)
    return not any(own) and not any(shared) and "forward" not in vars(module)


def _takes_patches(predictor: nn.Module, features: Tensor) -> bool:
    """The upsampling is a matmul one that computes ``features`` as a matmul, followed by a plain ReLU, hookless."""
    upsample, relu = predictor[0], predictor[1]
    return (type(upsample) is PatchConvTranspose2d and type(relu) is nn.ReLU
            and _hookless(upsample, allow_input_cast=True) and _hookless(relu)
            and upsample.computes_as_matmul(_upsampling_input(upsample, features)))


def _upsampling_input(upsample: nn.Module, features: Tensor) -> Tensor:
    """``features`` as the upsampling layer receives them: cast to its weight dtype by an input-cast pre-hook (the
    low-precision-weights mode's), when it has one and they are floating point of another dtype."""
    if (any(_casts_inputs(h) for h in upsample._forward_pre_hooks.values()) and features.is_floating_point()
            and features.dtype != upsample.weight.dtype):
        return features.to(upsample.weight.dtype)
    return features


def _logits_from_patches(predictor: nn.Module, conv: nn.Conv2d, features: Tensor, labels: Tensor) -> Tensor:
    """The own-class logits from the upsampling's patch-ordered product; only ``[K, S, S]`` is put in pixel order."""
    upsample = predictor[0]
    k, _, height, width = features.shape
    _, channels, kh, kw = upsample.weight.shape
    features = _upsampling_input(upsample, features)
    patches = torch.relu_(patch_products(features, upsample.weight, upsample.bias))  # [K*H*W, kh*kw*C], fresh
    patches, weight = _in_compute_dtype(patches.view(k, height * width * kh * kw, channels),
                                        conv.weight[labels, :, 0, 0])
    out = chunked_bmm(patches, weight.unsqueeze(-1))  # [K, H*W*kh*kw, 1], rows (i, j, a, b)
    out = out.view(k, height, width, kh, kw).permute(0, 1, 3, 2, 4).reshape(k, height * kh, width * kw)
    return _with_bias(out, conv, labels)


def _with_bias(logits: Tensor, conv: nn.Conv2d, labels: Tensor) -> Tensor:
    """``logits [K, S, S]`` plus each RoI's class bias, when the convolution has one."""
    if conv.bias is None:
        return logits
    return logits + conv.bias[labels].to(logits.dtype)[:, None, None]
