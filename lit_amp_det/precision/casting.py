"""Mixed-precision casting helpers: recursive dtype casts, per-module opt-in, and fp32/fp16 regions.

Detection heads hold numerically fragile code (box decoding, IoU, losses, sampling) that must run in float32
while the rest of the network runs in float16/bfloat16. As in MMCV's ``fp16_utils``, a module opts in through
an attribute (:func:`set_mixed_precision`) and its methods mark regions with :func:`force_fp32` /
:func:`auto_fp16`; :func:`wrap_method` does the same for one instance of a third-party class. Unlike MMCV this
works with ``torch.autocast`` on CUDA and CPU, knows bfloat16 and traces under ``torch.compile`` without graph
breaks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from lit_amp_det.precision.modes import REGION_MODES, RegionMode

__all__ = [
    "LOW_PRECISION_DTYPES",
    "AMP_DTYPE_ATTR",
    "REGION_ATTR",
    "cast_tensor_type",
    "mixed_precision_dtype",
    "set_mixed_precision",
    "force_fp32",
    "auto_fp16",
    "wrap_method",
    "unwrap_method",
]

#: The dtypes a module may run in when mixed precision is on for it.
LOW_PRECISION_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
#: Attribute holding the low-precision dtype of a module (or plain object) with mixed precision on.
AMP_DTYPE_ATTR = "_lit_amp_dtype"
#: Attribute marking a decorated or instance-wrapped callable: "fp32", "fp16" or "fp32_outputs".
REGION_ATTR = "__lit_amp_region__"
_F = TypeVar("_F", bound=Callable[..., Any])


def _check_dtype(value: object, argument: str) -> torch.dtype:
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{argument} must be a torch.dtype such as torch.float32, got {value!r}")
    return value


def _cast(inputs: Any, src: tuple[torch.dtype, ...] | None, dst: torch.dtype) -> Any:
    """The recursion behind :func:`cast_tensor_type`, with arguments already validated. Containers are rebuilt
    as their own type where it can be, else as a plain dict, list or tuple.
    """
    if isinstance(inputs, torch.Tensor):
        matches = inputs.is_floating_point() if src is None else inputs.dtype in src
        return inputs.to(dst) if matches and inputs.dtype != dst else inputs
    if isinstance(inputs, nn.Module):  # parameters are cast by the caller's precision policy, not here
        return inputs
    if isinstance(inputs, Mapping):
        items = {k: _cast(v, src, dst) for k, v in inputs.items()}
        try:
            if isinstance(inputs, defaultdict):  # its constructor takes the factory first
                return type(inputs)(inputs.default_factory, items)
            return type(inputs)(items)
        except (
            Exception
        ):  # custom mappings with other constructors (MappingProxyType subclasses, configs, ...)
            return dict(items)
    if isinstance(inputs, (list, tuple)):
        values = [_cast(v, src, dst) for v in inputs]
        if isinstance(inputs, tuple) and hasattr(type(inputs), "_fields"):
            return type(inputs)(*values)  # namedtuples take their fields positionally
        try:
            return type(inputs)(values)
        except Exception:  # list/tuple subclasses with other constructors
            return list(values) if isinstance(inputs, list) else tuple(values)
    return inputs  # str, bytes, numpy arrays, numbers, None, arbitrary objects


def cast_tensor_type(
    inputs: Any, src_type: torch.dtype | Sequence[torch.dtype] | None, dst_type: torch.dtype
) -> Any:
    """Returns ``inputs`` with every tensor of dtype ``src_type`` converted to ``dst_type``.

    Recurses through mappings (type kept where it can be rebuilt, else a dict), lists, tuples and namedtuples,
    rebuilding rather than mutating them; everything else (modules included) is left alone. The casts are
    differentiable.

    Args:
        inputs (Any): a tensor, or a mapping, list or tuple holding tensors at any depth.
        src_type (torch.dtype or Sequence[torch.dtype] or None): the dtype(s) to convert; ``None`` converts
            every floating tensor.
        dst_type (torch.dtype): the dtype the matching tensors are converted to.

    Returns:
        Any: ``inputs`` rebuilt with the matching tensors converted; the same object when it is neither a
        tensor nor a container.

    Raises:
        TypeError: if ``src_type`` is not a dtype, a sequence of dtypes or ``None``, or ``dst_type`` is not a
            ``torch.dtype``.
    """
    if src_type is None or isinstance(src_type, torch.dtype):
        src: tuple[torch.dtype, ...] | None = (
            None if src_type is None else (src_type,)
        )  # None: any floating dtype
    elif isinstance(src_type, (str, bytes)) or not isinstance(src_type, Iterable):
        raise TypeError(
            f"src_type must be a torch.dtype, a sequence of them or None (any floating dtype), "
            f"got {src_type!r}"
        )
    else:
        src = tuple(_check_dtype(d, "every entry of src_type") for d in src_type)
    return _cast(inputs, src, _check_dtype(dst_type, "dst_type"))


def mixed_precision_dtype(obj: object) -> torch.dtype | None:
    """The low-precision dtype ``obj`` runs in, or None when mixed precision is off for it.

    Args:
        obj (object): a module or plain object that :func:`set_mixed_precision` may have marked.

    Returns:
        torch.dtype or None: ``torch.float16`` or ``torch.bfloat16`` while mixed precision is on for ``obj``,
        else ``None``.
    """
    return getattr(obj, AMP_DTYPE_ATTR, None)


def set_mixed_precision(obj: nn.Module | object, dtype: torch.dtype | None) -> None:
    """Turns mixed precision on (``dtype`` float16/bfloat16) or off (None) for ``obj`` and, for a module, all
    its submodules, so every decorated method below it sees the same setting.

    Args:
        obj (nn.Module or object): the module (with its submodules) or plain object to mark.
        dtype (torch.dtype, optional): ``torch.float16`` or ``torch.bfloat16`` to turn mixed precision on,
            ``None`` to turn it off.

    Raises:
        ValueError: if ``dtype`` is neither ``torch.float16``, ``torch.bfloat16`` nor ``None``.
    """
    if dtype is not None and dtype not in LOW_PRECISION_DTYPES:
        raise ValueError(f"dtype must be torch.float16, torch.bfloat16 or None (off), got {dtype!r}")
    for target in obj.modules() if isinstance(obj, nn.Module) else (obj,):
        if dtype is not None:
            setattr(target, AMP_DTYPE_ATTR, dtype)
            continue
        with contextlib.suppress(AttributeError):
            delattr(target, AMP_DTYPE_ATTR)
        if mixed_precision_dtype(target) is not None:  # a class-level default still shows through: shadow it
            setattr(target, AMP_DTYPE_ATTR, None)


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """A context switching autocast off for ``device_type`` if it is on now, else a no-op context. Entered by
    ``with`` (not an ExitStack) because torch.compile traces only autocast contexts entered so.
    """
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def _first_tensor(values: Any) -> torch.Tensor | None:
    if isinstance(values, torch.Tensor):
        return values
    if isinstance(values, Mapping):
        values = values.values()
    elif not isinstance(values, (list, tuple)):
        return None
    return next((found for found in map(_first_tensor, values) if found is not None), None)


def _checked_apply_to(
    decorator: str, func: Callable[..., Any], signature: inspect.Signature, apply_to: Iterable[str] | None
) -> frozenset[str] | None:
    """Validates ``apply_to`` against ``func``'s parameters (self excluded); None means all arguments."""
    if apply_to is None:
        return None
    if isinstance(apply_to, (str, bytes)):
        raise TypeError(
            f"{decorator}(apply_to={apply_to!r}) must be a list of names, e.g. apply_to=[{apply_to!r}]"
        )
    names = list(apply_to)
    parameters = list(signature.parameters)[1:]  # the first one is self
    for name in names:
        if name not in parameters:
            raise ValueError(
                f"{decorator}(apply_to={names!r}) names {name!r}, which is not a parameter of "
                f"{func.__qualname__}{signature}; use only the names after self, or apply_to=None for all"
            )
    return frozenset(names)


@dataclasses.dataclass(frozen=True)
class _ArgumentPlan:
    """Which positions and keywords of a call to cast, worked out once from the signature: per-call
    ``Signature.bind`` breaks torch.compile graphs once traced code has mutated a dict; lookups against this
    plan trace cleanly. ``None`` in place of a plan means "cast all but self".
    """

    positions: frozenset[int]  # indices into args, self being index 0
    keywords: frozenset[str]  # keyword arguments to cast
    var_positional_from: int | None  # cast args[i:] when *args is named
    var_keyword: bool  # cast keywords that match no parameter when **kwargs is named
    parameter_keywords: frozenset[str]  # keywords that bind to a named parameter

    @classmethod
    def build(cls, signature: inspect.Signature, names: frozenset[str]) -> _ArgumentPlan:
        kind = inspect.Parameter
        positions, keywords, parameter_keywords = set(), set(), set()
        var_positional_from, var_keyword = None, False
        for index, parameter in enumerate(signature.parameters.values()):
            wanted = parameter.name in names
            if parameter.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD) and wanted:
                positions.add(index)
            if parameter.kind in (kind.POSITIONAL_OR_KEYWORD, kind.KEYWORD_ONLY):
                parameter_keywords.add(parameter.name)
                if wanted:
                    keywords.add(parameter.name)
            if parameter.kind is kind.VAR_POSITIONAL and wanted:
                var_positional_from = index  # positional parameters all come before *args
            if parameter.kind is kind.VAR_KEYWORD:
                var_keyword = wanted
        return cls(
            frozenset(positions),
            frozenset(keywords),
            var_positional_from,
            var_keyword,
            frozenset(parameter_keywords),
        )

    def casts_position(self, index: int) -> bool:
        start = self.var_positional_from
        return index in self.positions or (start is not None and index >= start)

    def casts_keyword(self, name: str) -> bool:
        return name in self.keywords or (self.var_keyword and name not in self.parameter_keywords)


def _region_decorator(
    decorator: str, region: str, apply_to: Iterable[str] | None, to_low: bool, run: Callable[..., Any]
) -> Callable[[_F], _F]:
    """The decorator behind :func:`force_fp32` and :func:`auto_fp16`: while mixed precision is on for the
    instance, the arguments ``apply_to`` names are cast to float32 (to its low dtype where ``to_low``) and the
    call returns ``run(func, low dtype, args, kwargs)``; otherwise the method runs unchanged.
    """

    def decorate(func: _F) -> _F:
        signature = inspect.signature(func)  # the argument plan is worked out once here, not per call
        names = _checked_apply_to(decorator, func, signature, apply_to)
        plan = None if names is None else _ArgumentPlan.build(signature, names)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            low = mixed_precision_dtype(args[0])
            if low is None:
                return func(*args, **kwargs)
            src, dst = ((torch.float32,), low) if to_low else (LOW_PRECISION_DTYPES, torch.float32)
            if plan is None:  # all but self (args[0])
                args, kwargs = (args[0], *_cast(args[1:], src, dst)), _cast(kwargs, src, dst)
            else:
                args = tuple(_cast(a, src, dst) if plan.casts_position(i) else a for i, a in enumerate(args))
                kwargs = {k: _cast(v, src, dst) if plan.casts_keyword(k) else v for k, v in kwargs.items()}
            return run(func, low, args, kwargs)

        setattr(wrapper, REGION_ATTR, region)  # callers can tell it is a region already and not wrap it again
        return wrapper  # type: ignore[return-value]

    return decorate


def force_fp32(apply_to: Iterable[str] | None = None, out_fp16: bool = False) -> Callable[[_F], _F]:
    """Decorates a method to run in float32 when mixed precision is on for its instance (else unchanged).

    The arguments named in ``apply_to`` have their float16/bfloat16 tensors cast to float32 and the body
    runs with autocast off (CUDA and CPU).

    Args:
        apply_to (Iterable[str], optional): names of the method's parameters to cast (not ``self``); ``None``
            casts every argument but ``self``. Default: ``None``.
        out_fp16 (bool): cast the method's float32 outputs back to the instance's low dtype. Default:
            ``False``.

    Returns:
        Callable: the decorator; the method it returns keeps the original's name and docstring.

    Raises:
        TypeError: when the decorator is applied, if ``apply_to`` is a single string instead of a list of
            names.
        ValueError: when the decorator is applied, if ``apply_to`` names something that is not a parameter of
            the method.
    """

    def run(func: Callable[..., Any], low: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with _autocast_off("cuda"), _autocast_off("cpu"):
            output = func(*args, **kwargs)
        return _cast(output, (torch.float32,), low) if out_fp16 else output

    return _region_decorator("force_fp32", "fp32", apply_to, to_low=False, run=run)


def auto_fp16(apply_to: Iterable[str] | None = None, out_fp32: bool = False) -> Callable[[_F], _F]:
    """Decorates a method to run in its instance's low dtype when mixed precision is on for it (else
    unchanged).

    The arguments named in ``apply_to`` have their float32 tensors cast to the low dtype and the body runs
    under ``torch.autocast`` on the first tensor argument's device type (else CUDA when available, else CPU).

    Args:
        apply_to (Iterable[str], optional): names of the method's parameters to cast (not ``self``); ``None``
            casts every argument but ``self``. Default: ``None``.
        out_fp32 (bool): cast the method's float16/bfloat16 outputs to float32. Default: ``False``.

    Returns:
        Callable: the decorator; the method it returns keeps the original's name and docstring.

    Raises:
        TypeError: when the decorator is applied, if ``apply_to`` is a single string instead of a list of
            names.
        ValueError: when the decorator is applied, if ``apply_to`` names something that is not a parameter of
            the method.
    """

    def run(func: Callable[..., Any], low: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tensor = _first_tensor((args[1:], kwargs))
        device_type = (
            tensor.device.type if tensor is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        with torch.autocast(device_type=device_type, dtype=low):
            output = func(*args, **kwargs)
        return _cast(output, LOW_PRECISION_DTYPES, torch.float32) if out_fp32 else output

    return _region_decorator("auto_fp16", "fp16", apply_to, to_low=True, run=run)


WrapMode = RegionMode


class _InstanceRegion:
    """Callable stored on one instance in place of its method ``name``, running it as a precision region; a
    class rather than a closure so that a deep copy or pickle of the owner calls the copied owner.
    """

    def __init__(self, owner: object, name: str, mode: WrapMode) -> None:
        bound = getattr(owner, name)
        # the unbound function where possible, so copies of the owner are not tied to this one
        is_method = inspect.ismethod(bound) and bound.__self__ is owner
        self.owner, self.name, self.mode = owner, name, mode
        # a flag, not a sentinel (sentinels do not survive deepcopy): an instance callable to restore on
        # unwrap
        self.shadowed_instance_attr = name in vars(owner)
        self.previous = vars(owner).get(name)
        self.function, self.is_method = (bound.__func__ if is_method else bound), is_method
        setattr(self, REGION_ATTR, mode)

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        """The original callable, so ``inspect.signature`` reports the wrapped method's parameters."""
        return self.function.__get__(self.owner) if self.is_method else self.function

    def _call_original(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return (
            self.function(self.owner, *args, **kwargs) if self.is_method else self.function(*args, **kwargs)
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if mixed_precision_dtype(self.owner) is None:  # decided per call: the policy may change
            return self._call_original(args, kwargs)
        if self.mode == "fp32":
            args, kwargs = _cast((args, kwargs), LOW_PRECISION_DTYPES, torch.float32)
            with _autocast_off("cuda"), _autocast_off("cpu"):
                return self._call_original(args, kwargs)
        return _cast(self._call_original(args, kwargs), LOW_PRECISION_DTYPES, torch.float32)

    def __repr__(self) -> str:
        return f"<{self.mode} region around {type(self.owner).__name__}.{self.name}>"


def _current(owner: object, name: str) -> Any:
    """``owner.<name>``, or an AttributeError naming the owner type, the name and the fix."""
    value = getattr(owner, name, None)
    if not callable(value):
        raise AttributeError(
            f"{type(owner).__name__} has no method {name!r} to wrap; pass the name of one of its methods"
        )
    return value


def wrap_method(owner: object, name: str, mode: WrapMode) -> None:
    """Makes ``owner.<name>`` a precision region on this instance only (its class is untouched).

    ``mode="fp32"`` behaves like :func:`force_fp32`; ``mode="fp32_outputs"`` casts the method's low-precision
    outputs to float32. Both do nothing while ``mixed_precision_dtype(owner)`` is None (checked per call).
    Wrapping again in the same mode is a no-op.

    Args:
        owner (object): the instance whose method is wrapped; it needs an instance ``__dict__``.
        name (str): the name of the method (or other callable attribute) to wrap.
        mode (str): ``"fp32"`` or ``"fp32_outputs"``.

    Raises:
        ValueError: if ``mode`` is not ``"fp32"`` or ``"fp32_outputs"``, or the method is already wrapped in
            the other mode (:func:`unwrap_method` first).
        AttributeError: if ``owner`` has no callable attribute ``name``.
        TypeError: if ``owner`` has no instance ``__dict__`` (``__slots__``); decorate the class's method
            with :func:`force_fp32` instead.
    """
    if mode not in REGION_MODES:
        raise ValueError(f"mode must be one of {REGION_MODES}, got {mode!r}")
    current = _current(owner, name)
    if isinstance(current, _InstanceRegion):
        if current.mode != mode:
            raise ValueError(
                f"{type(owner).__name__}.{name} is already wrapped with mode={current.mode!r}; "
                f"call unwrap_method first to switch to mode={mode!r}"
            )
        return
    if not hasattr(owner, "__dict__"):
        raise TypeError(
            f"cannot wrap {type(owner).__name__}.{name}: it has no instance __dict__ (uses __slots__); "
            "decorate the class method with force_fp32 instead"
        )
    setattr(owner, name, _InstanceRegion(owner, name, mode))


def unwrap_method(owner: object, name: str) -> None:
    """Undoes :func:`wrap_method` on ``owner.<name>``; a no-op when it is not wrapped.

    Args:
        owner (object): the instance whose method was wrapped.
        name (str): the name of the wrapped method.

    Raises:
        AttributeError: if ``owner`` has no callable attribute ``name``.
    """
    current = _current(owner, name)
    if not isinstance(current, _InstanceRegion):
        return
    if current.shadowed_instance_attr:
        setattr(owner, name, current.previous)
    else:
        delattr(owner, name)  # the class attribute shows through again
