"""Low-precision weights with fp32 master copies: MMCV's ``wrap_fp16_model`` + ``patch_norm_fp32`` + fp32
masters.

Autocast keeps parameters in fp32 and casts each weight to bf16/fp16 at every use (and its gradient back in
the backward). Here the model holds its weights in the low dtype, so forward and backward use them as they
are, and the optimizer steps an fp32 *master* copy of each: after backward each low-precision gradient goes
into its master's fp32 gradient, the optimizer updates the masters, and the low-precision weights are
refreshed from them, so small updates accumulate in fp32 instead of vanishing in bf16 rounding.

What stays fp32:

* **norm layers** -- every parameter and buffer. BatchNorm and FrozenBatchNorm2d take the low-precision
  activations directly (their kernels compute statistics in fp32 and return the input dtype); the other norms
  get fp32 inputs and return the low dtype (MMCV's ``patch_norm_fp32``);
* **buffers** of every other module;
* **fp32 regions** of :mod:`lit_amp_det.precision.regions` (losses, box coding, post-processing). A module
  with low-precision weights casts its floating inputs to its weights' dtype, so regions are for
  parameter-free code.

The masters live beside the model (not in its ``_parameters``), so DDP, hooks and ``named_parameters`` see one
set of parameters; ``state_dict()`` returns the fp32 masters under the parameters' keys and
``load_state_dict`` writes them too, so checkpoints hold fp32 weights that load into a model of any precision.
:meth:`MasterWeights.attach` points an optimizer at the masters.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torchvision.ops
from torch import Tensor, nn

from lit_amp_det.precision.casting import LOW_PRECISION_DTYPES, cast_tensor_type

__all__ = [
    "NORM_LAYERS",
    "MasterWeights",
    "full_precision_copy",
    "holds_masters",
    "master_weights_of",
    "use_low_precision_weights",
]

_BATCH_NORMS: tuple[type[nn.Module], ...] = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
#: Norms that take a low-precision input with fp32 parameters natively; the others are given fp32 inputs.
_NATIVE_MIXED_NORMS: tuple[type[nn.Module], ...] = (*_BATCH_NORMS, torchvision.ops.FrozenBatchNorm2d)
#: Norm layers whose parameters and buffers stay fp32 (lit_amp_det's FrozenBatchNorm2d subclasses
#: torchvision's).
NORM_LAYERS: tuple[type[nn.Module], ...] = (
    *_NATIVE_MIXED_NORMS,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.RMSNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LocalResponseNorm,
)
#: Attribute of a converted module holding ``{parameter name: fp32 master}`` for its own parameters.
_MASTERS_ATTR = "_lit_master_params"
#: Attribute of a converted module holding its low dtype (for the input-cast hook).
_DTYPE_ATTR = "_lit_weight_dtype"
#: Attribute of the converted root module holding its :class:`MasterWeights`.
_WEIGHTS_ATTR = "_lit_master_weights"


# Hooks are module-level functions reading state from the module they run on, so a deep copy's hooks use its
# masters.
def _cast_inputs_to_weights(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook of a module with low-precision weights: floating inputs of another dtype are cast to
    it.
    """
    return cast_tensor_type(args, None, getattr(module, _DTYPE_ATTR))


def _norm_inputs_to_fp32(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook of a norm without mixed-dtype kernels: low-precision inputs run in fp32."""
    return cast_tensor_type(args, LOW_PRECISION_DTYPES, torch.float32)


def _norm_output_to_low(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    """Forward hook of the same norms: the fp32 output goes on in the model's low dtype."""
    return cast_tensor_type(output, (torch.float32,), getattr(module, _DTYPE_ATTR))


def _masters_into_state_dict(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """State-dict post-hook: the fp32 masters replace the module's low-precision parameters (same keys)."""
    for name, master in getattr(module, _MASTERS_ATTR).items():
        key = prefix + name
        if key in state_dict:
            state_dict[key] = master if isinstance(state_dict[key], nn.Parameter) else master.detach()


def _state_dict_into_masters(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook: the loaded values also become the masters (in fp32, before rounding);
    mismatched shapes are left to ``load_state_dict``, which reports them with the key.
    """
    for name, master in getattr(module, _MASTERS_ATTR).items():
        value = state_dict.get(prefix + name)
        if isinstance(value, Tensor) and value.shape == master.shape:
            with torch.no_grad():
                master.copy_(value)


class MasterWeights:
    """The low-precision parameters of a converted module and their fp32 masters, pair by pair.

    Built by :func:`use_low_precision_weights`. The low-precision parameters are the model's own (converted in
    place, so holders see the change); the masters are ``nn.Parameter`` objects held here and on their
    modules.

    Args:
        dtype (torch.dtype): the low-precision dtype of the converted parameters (``torch.float16`` or
            ``torch.bfloat16``).
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.masters: list[nn.Parameter] = []
        self._grad_buffers: dict[int, Tensor] = {}  # index of a pair -> its master's reusable gradient tensor
        self._attached: list[
            weakref.ReferenceType[torch.optim.Optimizer]
        ] = []  # deepcopy keeps weak refs as they are

    def __len__(self) -> int:
        return len(self.params)

    def pairs(self) -> Iterator[tuple[nn.Parameter, nn.Parameter]]:
        """``(low-precision parameter, fp32 master)`` for every converted parameter."""
        return zip(self.params, self.masters)

    def _convert_module(self, module: nn.Module, prefix: str) -> None:
        """Casts ``module``'s own floating parameters to the low dtype, keeping the fp32 values as masters."""
        masters: dict[str, nn.Parameter] = {}
        for name, param in module.named_parameters(recurse=False):
            if not param.is_floating_point() or param.dtype == self.dtype:
                continue
            # contiguous masters: fused optimizers clone and copy back every non-contiguous tensor at each
            # step
            original = param.detach()
            fp32 = original.to(torch.float32).contiguous()
            with (
                torch.no_grad()
            ):  # in place, as nn.Module.to() does: identity, hooks and memory format are kept
                param.data = original.to(self.dtype)
            masters[name] = master = nn.Parameter(fp32, requires_grad=param.requires_grad)
            self.names.append(prefix + name)
            self.params.append(param)
            self.masters.append(master)
        if not masters:
            return
        setattr(module, _MASTERS_ATTR, masters)
        setattr(module, _DTYPE_ATTR, self.dtype)
        module.register_forward_pre_hook(_cast_inputs_to_weights)
        module.register_state_dict_post_hook(_masters_into_state_dict)
        module.register_load_state_dict_pre_hook(_state_dict_into_masters)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Points ``optimizer`` at the masters in place of the low-precision parameters; its ``step()`` then
        moves the gradients to the masters first and refreshes the low-precision parameters after
        (idempotent).

        The optimizer must not have stepped the low-precision parameters yet (its state would be theirs).
        """
        pairs = {id(low): (name, master) for name, low, master in zip(self.names, self.params, self.masters)}
        for index, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                if id(param) not in pairs:
                    continue
                name, master = pairs[id(param)]
                if param in optimizer.state:
                    raise RuntimeError(
                        f"{type(optimizer).__name__} param_groups[{index}] has state for the "
                        f"low-precision parameter {name!r}: it stepped before the model got fp32 "
                        "masters. Build the optimizer after the precision plugin's convert_module "
                        "(Lightning does), then attach it."
                    )
                if master.device != param.device:  # the model was moved after conversion
                    master.data = master.data.to(param.device)
                group["params"][i] = master
        if any(ref() is optimizer for ref in self._attached):
            return
        self._attached.append(weakref.ref(optimizer))
        optimizer.register_step_pre_hook(self._before_step)
        optimizer.register_step_post_hook(self._after_step)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.grads_to_masters()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.refresh()

    def grads_to_masters(self) -> None:
        """Adds each low-precision gradient to its master's fp32 gradient and frees it (a no-op without any).

        Called after backward (and DDP's all-reduce), before clipping and the step. Each master's gradient
        tensor is reused across steps, so a large fp32 gradient is not freshly allocated every step.
        """
        for index, (low, master) in enumerate(self.pairs()):
            grad = low.grad
            if grad is None:
                continue
            if master.device != low.device:
                master.data = master.data.to(low.device)
            if master.grad is None:
                master.grad = self._grad_buffer(index, master).copy_(grad)
            else:  # onto a gradient someone left (zero_grad(set_to_none=False), several backwards)
                master.grad += grad.to(torch.float32)  # a cast and a same-dtype add: faster than a mixed add
            low.grad = None

    def _grad_buffer(self, index: int, master: nn.Parameter) -> Tensor:
        buffer = self._grad_buffers.get(index)
        if buffer is None or buffer.device != master.device:
            self._grad_buffers[index] = buffer = torch.empty_like(master, memory_format=torch.preserve_format)
        return buffer

    @torch.no_grad()
    def refresh(self) -> None:
        """Copies the masters into the low-precision parameters (after an optimizer step)."""
        for low, master in self.pairs():
            if master.requires_grad:
                low.copy_(master)


def use_low_precision_weights(module: nn.Module, dtype: torch.dtype) -> MasterWeights:
    """Converts ``module`` in place to ``dtype`` weights with fp32 masters; returns them (idempotent).

    Every floating parameter outside norm layers (:data:`NORM_LAYERS`) becomes ``dtype``; norms and buffers
    stay fp32.

    Args:
        module (nn.Module): the model to convert in place.
        dtype (torch.dtype): ``torch.float16`` or ``torch.bfloat16``.

    Returns:
        MasterWeights: the converted parameters and their fp32 masters; the existing ones when ``module`` was
        already converted to ``dtype``.

    Raises:
        ValueError: if ``dtype`` is not ``torch.float16`` or ``torch.bfloat16``, or ``module`` was already
            converted to the other low dtype.
    """
    if dtype not in LOW_PRECISION_DTYPES:
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
    existing = getattr(module, _WEIGHTS_ATTR, None)
    if existing is not None:
        if existing.dtype != dtype:
            raise ValueError(
                f"{type(module).__name__} already has {existing.dtype} weights with fp32 masters; "
                f"build a new model for {dtype} (or load its fp32 checkpoint into one)"
            )
        return existing
    weights = MasterWeights(dtype)
    _convert_tree(weights, module, "")
    setattr(module, _WEIGHTS_ATTR, weights)
    return weights


def _convert_tree(weights: MasterWeights, module: nn.Module, prefix: str) -> None:
    """Converts ``module`` and its descendants, norm layers (and anything inside them) excepted: those without
    mixed-dtype kernels get their inputs in fp32 and their outputs in the low dtype.
    """
    if isinstance(module, NORM_LAYERS):
        if not isinstance(module, _NATIVE_MIXED_NORMS):
            setattr(module, _DTYPE_ATTR, weights.dtype)
            module.register_forward_pre_hook(_norm_inputs_to_fp32)
            module.register_forward_hook(_norm_output_to_low)
        return
    weights._convert_module(module, prefix)
    for name, child in module.named_children():
        _convert_tree(weights, child, f"{prefix}{name}.")


def master_weights_of(module: nn.Module) -> MasterWeights | None:
    """The :class:`MasterWeights` of a module converted by :func:`use_low_precision_weights`, else None."""
    return getattr(module, _WEIGHTS_ATTR, None)


#: The hooks :func:`use_low_precision_weights` registers, by the ``nn.Module`` hook dict that holds them.
_CONVERSION_HOOKS = {
    "_forward_pre_hooks": (_cast_inputs_to_weights, _norm_inputs_to_fp32),
    "_forward_hooks": (_norm_output_to_low,),
    "_state_dict_hooks": (_masters_into_state_dict,),
    "_load_state_dict_pre_hooks": (_state_dict_into_masters,),
}


def holds_masters(module: nn.Module) -> bool:
    """Whether ``module`` or a module inside it has fp32 masters (a converted tree or a part of one)."""
    return any(_MASTERS_ATTR in m.__dict__ for m in module.modules())


def full_precision_copy(module: nn.Module) -> nn.Module:
    """A deep copy of a module converted by :func:`use_low_precision_weights` (or of a part of one) as it
    would be without the conversion: its fp32 masters as the parameters (in the parameters' memory format), no
    casting or state-dict hooks, no masters. ``module`` itself is untouched. Used for fp32 baselines of
    ``-weights`` runs.
    """
    if not holds_masters(module):
        raise ValueError(
            f"{type(module).__name__} has no fp32 masters: it was not converted by "
            "use_low_precision_weights, so copy.deepcopy gives its full-precision copy"
        )
    clone = copy.deepcopy(module)
    clone.__dict__.pop(_WEIGHTS_ATTR, None)  # absent when ``module`` is a part of the converted tree
    for submodule in clone.modules():
        masters = submodule.__dict__.pop(_MASTERS_ATTR, {})
        submodule.__dict__.pop(_DTYPE_ATTR, None)
        for name, master in masters.items():
            param = submodule._parameters[name]
            assert param is not None
            # in the parameter's strides: channels_last stays so
            param.data = torch.empty_like(param, dtype=master.dtype).copy_(master.detach())
        for hooks_attr, functions in _CONVERSION_HOOKS.items():
            hooks = getattr(submodule, hooks_attr)
            for key in [k for k, hook in hooks.items() if getattr(hook, "hook", hook) in functions]:
                del hooks[key]  # _load_state_dict_pre_hooks holds its functions in a wrapper (``.hook``)
    return clone
