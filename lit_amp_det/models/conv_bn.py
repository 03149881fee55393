"""Tune-mode conv-BN: a ``Conv2d -> BatchNorm`` pair in eval mode runs as one convolution during training.

While a BatchNorm normalises with its running statistics (eval mode or
:class:`~torchvision.ops.FrozenBatchNorm2d`), ``bn(conv(x)) == conv(x, W * s) + ((b - mean) * s + beta)`` with
``s = gamma / sqrt(var + eps)``. Building that folded weight on the fly keeps every gradient exact, but
autograd keeps a weight-sized copy instead of the conv output (Huang et al., "Tune-Mode ConvBN Blocks For
Efficient Transfer Learning", 2024). :func:`enable_conv_bn_eval` installs this without changing the module
tree or ``state_dict`` keys, and decides per call: a BatchNorm in training mode, or (``only_when_cheaper``) a
pair where the weight copy would cost more than the activation it saves, runs as plain ``conv -> norm``.
:func:`fold_conv_bn` is the permanent version for prediction and export.
"""

from __future__ import annotations

import warnings
import weakref
from collections import Counter

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torchvision.models import resnet
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.ops import FrozenBatchNorm2d

__all__ = [
    "NORM_TYPES",
    "conv_bn_eval_enabled",
    "conv_bn_eval_pairs",
    "disable_conv_bn_eval",
    "enable_conv_bn_eval",
    "find_conv_norm_pairs",
    "fold_conv_bn",
    "folded_weight_and_bias",
]

#: Norm layers that can be folded: (Sync)BatchNorm only in eval mode with running statistics;
#: FrozenBatchNorm2d always.
NORM_TYPES: tuple[type[nn.Module], ...] = (nn.BatchNorm2d, nn.SyncBatchNorm, FrozenBatchNorm2d)

Norm = nn.BatchNorm2d | nn.SyncBatchNorm | FrozenBatchNorm2d
Pair = tuple[str, str]


# ------------------------------------------------------------------------------------------- the fold


def _is_norm(module: nn.Module) -> bool:
    if isinstance(module, FrozenBatchNorm2d):
        return True
    return (
        isinstance(module, (nn.BatchNorm2d, nn.SyncBatchNorm))
        and module.track_running_stats
        and module.running_mean is not None
        and module.running_var is not None
    )


def _matches(conv: nn.Module, norm: nn.Module) -> bool:
    # a Conv2d with Conv2d's own forward (not e.g. weight standardisation) and zero padding, the fold's only
    # mode
    return (
        isinstance(conv, nn.Conv2d)
        and type(conv).forward is nn.Conv2d.forward
        and conv.padding_mode == "zeros"
        and _is_norm(norm)
        and norm.running_mean.shape[0] == conv.out_channels
    )


def _uses_running_stats(norm: Norm) -> bool:
    """Whether ``norm`` normalises with its running statistics right now (the fold is exact only then)."""
    return isinstance(norm, FrozenBatchNorm2d) or not norm.training


def folded_weight_and_bias(conv: nn.Conv2d, norm: Norm) -> tuple[Tensor, Tensor]:
    """The weight ``[C_out, C_in / groups, kh, kw]`` and bias ``[C_out]`` of the conv equal to
    ``norm(conv(x))``.

    Built from the live parameters and buffers with autograd on, so gradients flow to the conv's and norm's
    parameters. Computed in at least float32 and returned in ``conv.weight.dtype``. Uses the running
    statistics whatever the norm's mode.
    """
    dtype = torch.promote_types(conv.weight.dtype, torch.float32)
    mean = norm.running_mean.to(dtype)
    scale = torch.rsqrt(norm.running_var.to(dtype) + norm.eps)
    if norm.weight is not None:
        scale = scale * norm.weight.to(dtype)
    shift = (conv.bias.to(dtype) - mean) * scale if conv.bias is not None else -mean * scale
    if norm.bias is not None:
        shift = shift + norm.bias.to(dtype)
    weight = conv.weight.to(dtype) * scale.reshape(-1, 1, 1, 1)
    return weight.to(conv.weight.dtype), shift.to(conv.weight.dtype)


def _fold_is_cheaper(conv: nn.Conv2d, norm: Norm, x: Tensor) -> bool:
    """Whether folding reduces the memory kept for backward (always, when nothing is kept).

    The folded conv keeps a weight copy instead of its parameter, which pays only when the norm would keep a
    larger conv output: BatchNorm keeps its input, FrozenBatchNorm2d just a per-channel scale.
    """
    tensors = (x, conv.weight, conv.bias, norm.weight, norm.bias)
    if not (torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)):
        return True
    if isinstance(norm, FrozenBatchNorm2d):
        return False
    # N * C_out * H_out * W_out of conv(x) from shapes alone (x is [N, C, H, W] or [C, H, W])
    numel = (x.shape[0] if x.dim() == 4 else 1) * conv.out_channels
    for i, size in enumerate(x.shape[-2:]):
        if conv.padding == "same":
            numel *= size
            continue
        pad = 0 if conv.padding == "valid" else conv.padding[i]
        numel *= (size + 2 * pad - conv.dilation[i] * (conv.kernel_size[i] - 1) - 1) // conv.stride[i] + 1
    return numel > conv.weight.numel()


class _FoldedConv:
    """Stored as ``conv.forward``: runs the pair as one folded conv when the norm uses running statistics.

    A class rather than a closure so that deep copies and pickles of the model point at the copied conv and
    norm. The folded output is remembered (weakly) so :class:`_PassThroughNorm` can check it receives exactly
    that tensor.
    """

    def __init__(self, conv: nn.Conv2d, norm: Norm, names: Pair, only_when_cheaper: bool) -> None:
        self.conv, self.norm, self.names = conv, norm, names
        self.only_when_cheaper = only_when_cheaper
        self.active = True
        self.pending: weakref.ReferenceType[Tensor] | None = None

    def _folds(self, x: Tensor) -> bool:
        if not (self.active and _uses_running_stats(self.norm)):
            return False
        return not self.only_when_cheaper or _fold_is_cheaper(self.conv, self.norm, x)

    def __call__(self, input: Tensor) -> Tensor:
        self.pending = None
        conv = self.conv
        if not self._folds(input):
            return type(conv).forward(conv, input)
        weight, bias = folded_weight_and_bias(conv, self.norm)
        out = F.conv2d(input, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)
        self.pending = weakref.ref(out)
        return out

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "pending": None}  # weak references neither pickle nor belong in a copy

    def __repr__(self) -> str:
        return f"<conv-BN eval fold of {self.names[0]} -> {self.names[1]}>"


class _PassThroughNorm:
    """Stored as ``norm.forward``: passes the folded conv output through, otherwise runs the norm as usual."""

    def __init__(self, fold: _FoldedConv) -> None:
        self.fold = fold

    def __call__(self, input: Tensor) -> Tensor:
        fold = self.fold
        pending, fold.pending = fold.pending, None
        if pending is None:
            return type(fold.norm).forward(fold.norm, input)
        if pending() is input:
            return input
        conv_name, norm_name = fold.names
        raise RuntimeError(
            f"conv-BN eval: {norm_name!r} received a tensor other than the folded output of "
            f"{conv_name!r} (a forward hook or wrapper between them changed it), so it cannot pass the "
            "output through; remove that hook or call "
            "lit_amp_det.models.conv_bn.disable_conv_bn_eval(model) (callbacks.conv_bn_eval=null)"
        )

    def __repr__(self) -> str:
        return f"<conv-BN eval pass-through of {self.fold.names[1]}>"


# ------------------------------------------------------------------------------------- finding pairs


class _PairTracer(fx.Tracer):
    """Keeps convs and norms as single ``call_module`` nodes (FrozenBatchNorm2d lives outside
    ``torch.nn``).
    """

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, (nn.Conv2d, *NORM_TYPES)) or super().is_leaf_module(m, module_qualified_name)


def _fx_pairs(module: nn.Module) -> list[Pair]:
    """Pairs in the traced graph of ``module``: a conv node whose only user is a norm called on it alone."""
    graph = _PairTracer().trace(module)
    calls = Counter(node.target for node in graph.nodes if node.op == "call_module")
    pairs = []
    for node in graph.nodes:
        if node.op != "call_module" or calls[node.target] != 1 or len(node.users) != 1:
            continue
        (user,) = node.users
        if (
            user.op == "call_module"
            and calls[user.target] == 1
            and user.args == (node,)
            and not user.kwargs
            and _matches(module.get_submodule(node.target), module.get_submodule(user.target))
        ):
            pairs.append((node.target, user.target))
    return pairs


def _sequence_pairs(
    children: list[tuple[str, nn.Module]], exclude: frozenset[str] = frozenset()
) -> list[Pair]:
    """Consecutive ``(conv, norm)`` children of a container whose forward chains them one into the next."""
    return [
        (a, b)
        for (a, conv), (b, norm) in zip(children, children[1:])
        if a not in exclude and _matches(conv, norm)
    ]


def _structural_pairs(module: nn.Module) -> list[Pair]:
    """Pairs among the direct children of torchvision ResNet pieces and ``nn.Sequential`` containers.

    Relies on the dataflow of those classes' own ``forward`` (checked by identity, so subclasses that change
    it are skipped), including two torchvision internals (``ResNet._forward_impl`` and
    ``IntermediateLayerGetter``).
    """
    forward, children = type(module).forward, list(module.named_children())
    named = dict(children)
    if forward is resnet.ResNet.forward and type(module)._forward_impl is resnet.ResNet._forward_impl:
        candidates = [("conv1", "bn1")]
    elif forward is resnet.BasicBlock.forward:
        candidates = [("conv1", "bn1"), ("conv2", "bn2")]
    elif forward is resnet.Bottleneck.forward:
        candidates = [("conv1", "bn1"), ("conv2", "bn2"), ("conv3", "bn3")]
    elif forward is nn.Sequential.forward:  # also torchvision.ops.Conv2dNormActivation
        return _sequence_pairs(children)
    elif forward is IntermediateLayerGetter.forward:  # a returned conv output has a second user
        return _sequence_pairs(children, exclude=frozenset(module.return_layers))
    else:
        return []
    return [(a, b) for a, b in candidates if a in named and b in named and _matches(named[a], named[b])]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _find(module: nn.Module, prefix: str, use_fx: bool) -> list[Pair]:
    if next(module.children(), None) is None:
        return []
    if use_fx:
        try:
            return [(_join(prefix, a), _join(prefix, b)) for a, b in _fx_pairs(module)]
        except Exception:  # noqa: BLE001
            pass  # any tracing failure (data-dependent control flow, ...) means: look inside
    pairs = [(_join(prefix, a), _join(prefix, b)) for a, b in _structural_pairs(module)]
    for name, child in module.named_children():
        pairs += _find(child, _join(prefix, name), use_fx)
    return pairs


def find_conv_norm_pairs(model: nn.Module, *, method: str = "auto") -> list[Pair]:
    """Qualified names ``(conv, norm)`` of every Conv2d whose output feeds nothing but a foldable norm.

    Args:
        model: any module; ``named_modules()`` order is kept in the result. method: ``"auto"`` traces
        ``model`` with ``torch.fx`` and, where a module does not trace, recurses into its
            children, reading ResNet blocks and ``nn.Sequential`` containers structurally; ``"structure"``
            never traces.

    Norms: :data:`NORM_TYPES`; BatchNorms only with running statistics. A conv or norm called more than once,
    or a conv whose output has a second user, is not paired.
    """
    if method not in ("auto", "structure"):
        raise ValueError(f"method must be 'auto' or 'structure', got {method!r}")
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    pairs = set(_find(model, "", use_fx=method == "auto"))
    return sorted(pairs, key=lambda pair: (order.get(pair[0], len(order)), pair[1]))


# ------------------------------------------------------------------------------------------- public API


def _installed(module: nn.Module) -> _FoldedConv | _PassThroughNorm | None:
    override = vars(module).get("forward")
    return override if isinstance(override, (_FoldedConv, _PassThroughNorm)) else None


def disable_conv_bn_eval(model: nn.Module) -> None:
    """Removes what :func:`enable_conv_bn_eval` installed on ``model``; a no-op when nothing is."""
    for module in model.modules():
        override = _installed(module)
        if override is not None:
            (override if isinstance(override, _FoldedConv) else override.fold).active = False
            del module.forward  # the class's forward shows through again


def conv_bn_eval_enabled(model: nn.Module) -> bool:
    """Whether any conv of ``model`` runs through :func:`enable_conv_bn_eval`'s fold."""
    return any(isinstance(_installed(m), _FoldedConv) for m in model.modules())


def conv_bn_eval_pairs(model: nn.Module) -> list[Pair]:
    """The ``(conv, norm)`` pairs of ``model`` that run through the fold now, by their current names.

    A pair whose norm was replaced since :func:`enable_conv_bn_eval` (e.g. by ``convert_sync_batchnorm``) is
    missing here: enable again to pick up the new module.
    """
    names = {id(module): name for name, module in model.named_modules()}
    pairs = []
    for name, module in model.named_modules():
        fold = _installed(module)
        if isinstance(fold, _FoldedConv) and id(fold.norm) in names and _installed(fold.norm) is not None:
            pairs.append((name, names[id(fold.norm)]))
    return pairs


def enable_conv_bn_eval(model: nn.Module, *, only_when_cheaper: bool = True) -> list[Pair]:
    """Makes every conv-norm pair of ``model`` run as one folded conv whenever its norm uses running
    statistics.

    Module tree and ``state_dict`` keys are unchanged; outputs and gradients equal the plain model's up to
    float rounding. Decided per call: a BatchNorm in training mode runs as plain ``conv -> norm``. Calling
    again re-installs (with the new ``only_when_cheaper``).

    Args:
        only_when_cheaper: fold a call only when that saves memory held for backward: for a BatchNorm, when
        the conv
            output (``N * C_out * H_out * W_out``) is larger than the folded weight (``C_out * C_in / groups *
            kh * kw``); a FrozenBatchNorm2d keeps no activation, so it stays unfolded while gradients are
            recorded. Without an autograd graph every pair folds. ``False`` folds every call.

    Returns:
        The ``(conv, norm)`` pairs installed.
    """
    disable_conv_bn_eval(model)
    modules = dict(model.named_modules())
    installed = []
    for conv_name, norm_name in find_conv_norm_pairs(model):
        conv, norm = modules[conv_name], modules[norm_name]
        if "forward" in vars(conv) or "forward" in vars(norm):
            warnings.warn(
                f"conv-BN eval: {conv_name!r} or {norm_name!r} already has an instance-level forward "
                "(another wrapper); that pair is left unfolded",
                stacklevel=2,
            )
            continue
        fold = _FoldedConv(conv, norm, (conv_name, norm_name), only_when_cheaper)
        conv.forward = fold
        norm.forward = _PassThroughNorm(fold)
        installed.append((conv_name, norm_name))
    return installed


def fold_conv_bn(model: nn.Module) -> nn.Module:
    """Folds every conv-norm pair permanently, for prediction and export; returns ``model`` (changed in
    place).

    Each conv gets the folded weight and a bias, each norm becomes ``nn.Identity``: outputs equal the eval
    model's, but the ``state_dict`` changes and the norms cannot train any more. BatchNorms must be in eval
    mode.
    """
    pairs = find_conv_norm_pairs(model)
    modules = dict(model.named_modules())
    training = [norm for _, norm in pairs if not _uses_running_stats(modules[norm])]
    if training:
        raise ValueError(
            f"fold_conv_bn folds with the running statistics, but {training} are in training mode; "
            "call model.eval() first"
        )
    disable_conv_bn_eval(model)
    for conv_name, norm_name in pairs:
        conv = modules[conv_name]
        with torch.no_grad():
            weight, bias = folded_weight_and_bias(conv, modules[norm_name])
        trainable = conv.weight.requires_grad
        conv.weight = nn.Parameter(weight, requires_grad=trainable)
        conv.bias = nn.Parameter(bias, requires_grad=trainable)
        parent, _, child = norm_name.rpartition(".")
        setattr(model.get_submodule(parent), child, nn.Identity())
    return model
