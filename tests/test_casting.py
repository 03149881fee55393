"""Mixed-precision casting helpers: recursive casts, the per-module switch, fp32/fp16 regions, wrapping."""

from __future__ import annotations

import copy
import inspect
import pickle
import warnings
from collections import OrderedDict, defaultdict
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch import nn

from lit_amp_det.precision.casting import (
    AMP_DTYPE_ATTR,
    LOW_PRECISION_DTYPES,
    REGION_ATTR,
    auto_fp16,
    cast_tensor_type,
    force_fp32,
    mixed_precision_dtype,
    set_mixed_precision,
    unwrap_method,
    wrap_method,
)


def _cpu_autocast_supports(dtype: torch.dtype) -> bool:
    """True when CPU autocast really runs a matmul in ``dtype`` (older torch warns and disables fp16)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast("cpu", dtype=dtype):
            a = torch.ones(2, 2)
            return torch.is_autocast_enabled("cpu") and (a @ a).dtype == dtype


LOW_DTYPES = [
    torch.bfloat16,
    pytest.param(
        torch.float16,
        marks=pytest.mark.skipif(
            not _cpu_autocast_supports(torch.float16), reason="this torch's CPU autocast lacks float16"
        ),
    ),
]


class Pair(NamedTuple):
    boxes: torch.Tensor
    labels: torch.Tensor


# ------------------------------------------------------------------------------------ cast_tensor_type


def _nested() -> dict[str, Any]:
    return {
        "f32": torch.ones(2),
        "f16": torch.ones(2, dtype=torch.float16),
        "bf16": torch.ones(2, dtype=torch.bfloat16),
        "f64": torch.ones(2, dtype=torch.float64),
        "labels": torch.arange(3),
        "mask": torch.ones(2, dtype=torch.bool),
        "list": [torch.ones(1), "text", b"raw", np.zeros(2, dtype=np.float32), 3, None],
        "tuple": (torch.ones(1), nn.Linear(2, 2)),
        "pair": Pair(torch.ones(1, 4), torch.arange(1)),
        "ordered": OrderedDict(x=torch.ones(1), y=torch.ones(1, dtype=torch.float16)),
        "default": defaultdict(list, z=torch.ones(1)),
    }


def test_cast_tensor_type_changes_only_source_dtype_and_keeps_containers() -> None:
    inputs = _nested()
    out = cast_tensor_type(inputs, torch.float32, torch.float16)

    assert type(out) is dict and out.keys() == inputs.keys()
    assert out["f32"].dtype == torch.float16
    assert out["bf16"].dtype == torch.bfloat16 and out["f64"].dtype == torch.float64
    for key in ("f16", "bf16", "f64", "labels", "mask"):  # untouched tensors are passed through as-is
        assert out[key] is inputs[key]
    assert type(out["list"]) is list and out["list"][0].dtype == torch.float16
    assert out["list"][1:3] == ["text", b"raw"] and out["list"][4:] == [3, None]
    assert out["list"][3] is inputs["list"][3] and out["list"][3].dtype == np.float32
    assert type(out["tuple"]) is tuple and out["tuple"][0].dtype == torch.float16
    assert out["tuple"][1] is inputs["tuple"][1] and out["tuple"][1].weight.dtype == torch.float32
    assert type(out["pair"]) is Pair
    assert out["pair"].boxes.dtype == torch.float16 and out["pair"].labels.dtype == torch.int64
    assert type(out["ordered"]) is OrderedDict and list(out["ordered"]) == ["x", "y"]
    assert out["ordered"]["x"].dtype == torch.float16
    assert type(out["default"]) is defaultdict and out["default"].default_factory is list
    assert out["default"]["z"].dtype == torch.float16


def test_cast_tensor_type_does_not_mutate_its_input() -> None:
    inputs = _nested()

    def summary() -> dict[str, Any]:
        return {k: (type(v), v.dtype if isinstance(v, torch.Tensor) else None) for k, v in inputs.items()}

    before = summary()
    list_items, ordered_items = list(inputs["list"]), dict(inputs["ordered"])

    cast_tensor_type(inputs, None, torch.bfloat16)

    assert summary() == before
    assert all(a is b for a, b in zip(inputs["list"], list_items, strict=True))
    assert inputs["list"][0].dtype == torch.float32 and inputs["pair"].boxes.dtype == torch.float32
    assert inputs["ordered"]["x"] is ordered_items["x"] and ordered_items["x"].dtype == torch.float32
    assert inputs["default"]["z"].dtype == torch.float32


def test_cast_tensor_type_source_none_means_every_floating_dtype_and_tuples_several() -> None:
    inputs = _nested()
    every = cast_tensor_type(inputs, None, torch.bfloat16)
    assert [every[k].dtype for k in ("f32", "f16", "bf16", "f64")] == [torch.bfloat16] * 4
    assert every["labels"].dtype == torch.int64 and every["mask"].dtype == torch.bool

    low = cast_tensor_type(inputs, LOW_PRECISION_DTYPES, torch.float32)
    assert [low[k].dtype for k in ("f32", "f16", "bf16", "f64")] == [torch.float32] * 3 + [torch.float64]
    assert low["ordered"]["y"].dtype == torch.float32


def test_cast_tensor_type_keeps_gradients_flowing() -> None:
    x = torch.randn(3, requires_grad=True)
    (y,) = cast_tensor_type([x], torch.float32, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.requires_grad
    (y.float() * 2).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_cast_tensor_type_rejects_bad_dtypes() -> None:
    with pytest.raises(TypeError, match=r"\bdst_type\b"):
        cast_tensor_type(torch.ones(1), torch.float32, "float16")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="src_type"):
        cast_tensor_type(torch.ones(1), "float32", torch.float16)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="src_type"):
        cast_tensor_type(torch.ones(1), [torch.float32, "x"], torch.float16)  # type: ignore[list-item]


# --------------------------------------------------------------------------------- set_mixed_precision


def test_set_mixed_precision_covers_submodules_and_plain_objects_and_turns_off() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU()))
    assert mixed_precision_dtype(model) is None
    set_mixed_precision(model, torch.float16)
    assert [mixed_precision_dtype(m) for m in model.modules()] == [torch.float16] * 4
    set_mixed_precision(model, None)
    assert all(AMP_DTYPE_ATTR not in vars(m) for m in model.modules())
    assert mixed_precision_dtype(model[1][0]) is None

    class Plain:
        pass

    obj = Plain()
    set_mixed_precision(obj, torch.bfloat16)
    assert mixed_precision_dtype(obj) == torch.bfloat16
    set_mixed_precision(obj, None)
    assert mixed_precision_dtype(obj) is None
    with pytest.raises(ValueError, match=r"\bdtype\b.*torch\.float32"):
        set_mixed_precision(obj, torch.float32)


# ------------------------------------------------------------------------------------------ decorators


class Head(nn.Module):
    """Records what each decorated method saw so the tests can check the region it ran in."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen: dict[str, Any] = {}

    @auto_fp16(out_fp32=True)
    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        label_dtype = None if labels is None else labels.dtype
        self.seen["forward"] = (x.dtype, torch.is_autocast_enabled("cpu"), label_dtype)
        return self.linear(x)

    @force_fp32()
    def loss(self, score: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        matmul_dtype = (score @ score.T).dtype
        self.seen["loss"] = (score.dtype, target.dtype, torch.is_autocast_enabled("cpu"), matmul_dtype)
        return ((score - target) ** 2).mean()

    @force_fp32(apply_to=["score"], out_fp16=True)
    def decode(self, score: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        self.seen["decode"] = (score.dtype, other.dtype)
        return score * 2

    @auto_fp16(apply_to=["x"])
    def embed(self, x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen["embed"] = (x.dtype, keep.dtype)
        return x, keep


def test_decorators_are_exact_no_ops_with_mixed_precision_off() -> None:
    head = Head()
    x = torch.randn(2, 4)
    out = head(x)
    assert out.dtype == torch.float32 and torch.equal(out, head.linear(x))
    assert head.seen["forward"] == (torch.float32, False, None)

    # under an outer autocast the undecorated behaviour (low-precision matmuls, autocast on) is kept
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = head(x)
        score = out.detach()
        loss = head.loss(score, score)
    assert out.dtype == torch.bfloat16 and head.seen["forward"] == (torch.float32, True, None)
    assert head.seen["loss"] == (torch.bfloat16, torch.bfloat16, True, torch.bfloat16)
    assert loss.dtype == torch.bfloat16
    assert head.decode(score, score).dtype == torch.bfloat16 and head.seen["decode"] == (torch.bfloat16,) * 2


@pytest.mark.parametrize("low", LOW_DTYPES)
def test_force_fp32_casts_inputs_and_disables_autocast(low: torch.dtype) -> None:
    head = Head()
    set_mixed_precision(head, low)
    score = torch.randn(2, 4).to(low)
    with torch.autocast("cpu", dtype=low):
        loss = head.loss(score, score.clone())
        assert torch.is_autocast_enabled("cpu")  # restored after the region
    assert head.seen["loss"] == (torch.float32, torch.float32, False, torch.float32)
    assert loss.dtype == torch.float32


@pytest.mark.parametrize("low", LOW_DTYPES)
def test_force_fp32_apply_to_restricts_casts_and_out_fp16_casts_back(low: torch.dtype) -> None:
    head = Head()
    set_mixed_precision(head, low)
    score = torch.randn(2, 4).to(low)
    with torch.autocast("cpu", dtype=low):
        out = head.decode(score, other=score)
    assert head.seen["decode"] == (torch.float32, low)
    assert out.dtype == low and torch.equal(out, score * 2)


@pytest.mark.parametrize("low", LOW_DTYPES)
def test_auto_fp16_casts_float32_inputs_runs_autocast_and_out_fp32(low: torch.dtype) -> None:
    head = Head()
    set_mixed_precision(head, low)
    x, labels = torch.randn(2, 4), torch.arange(2)
    out = head(x, labels=labels)  # no outer autocast: the decorator opens one
    assert head.seen["forward"] == (low, True, torch.int64)
    assert out.dtype == torch.float32
    with torch.autocast("cpu", dtype=low):
        assert torch.equal(out, head.linear(x.to(low)).float())
    assert not torch.is_autocast_enabled("cpu")

    kept = torch.randn(3)
    cast, same = head.embed(torch.randn(3), kept)  # apply_to=["x"]; no out_fp32
    assert head.seen["embed"] == (low, torch.float32) and cast.dtype == low and same is kept


def test_apply_to_follows_keywords_varargs_and_keyword_only_parameters() -> None:
    class Mixed:
        @force_fp32(apply_to=["a", "rest", "k", "extra"])
        def f(self, a: Any, b: Any, *rest: Any, k: Any, j: Any, **extra: Any) -> dict[str, Any]:
            return {"a": a, "b": b, "rest": rest, "k": k, "j": j, **extra}

        @force_fp32(apply_to=["b"])
        def g(self, a: Any, b: Any) -> tuple[Any, Any]:
            return a, b

    obj = Mixed()
    set_mixed_precision(obj, torch.float16)
    x = torch.ones(1, dtype=torch.float16)
    out = obj.f(x, x, x, x, k=x, j=x, z=x)
    seen = {k: v.dtype if isinstance(v, torch.Tensor) else [t.dtype for t in v] for k, v in out.items()}
    f32, f16 = torch.float32, torch.float16
    assert seen == {"a": f32, "b": f16, "rest": [f32, f32], "k": f32, "j": f16, "z": f32}
    assert [t.dtype for t in obj.g(b=x, a=x)] == [f16, f32]
    assert [t.dtype for t in obj.g(x, x)] == [f16, f32]


def test_decorated_methods_keep_metadata_and_carry_the_region_marker() -> None:
    assert getattr(Head.loss, REGION_ATTR) == "fp32" and getattr(Head.decode, REGION_ATTR) == "fp32"
    assert getattr(Head.forward, REGION_ATTR) == "fp16"
    assert Head.loss.__name__ == "loss" and Head.loss.__qualname__ == "Head.loss"
    assert list(inspect.signature(Head.loss).parameters) == ["self", "score", "target"]


def test_unknown_apply_to_name_raises_at_decoration_time() -> None:
    expected = r"apply_to=\['x'\].*Box\.loss\(self, cls_score, bbox_pred\)"
    with pytest.raises(ValueError, match=expected):

        class Box:
            @force_fp32(apply_to=["x"])
            def loss(self, cls_score, bbox_pred):  # type: ignore[no-untyped-def]
                return cls_score

    with pytest.raises(ValueError, match=r"auto_fp16.*'self'"):
        auto_fp16(apply_to=["self"])(lambda self, x: x)
    with pytest.raises(TypeError, match=r"apply_to=\['x'\]"):
        force_fp32(apply_to="x")(lambda self, x: x)


def test_decorators_work_on_plain_object_methods() -> None:
    class Coder:
        @force_fp32(out_fp16=True)
        def decode(self, deltas: torch.Tensor) -> tuple[torch.Tensor, bool]:
            return deltas * 2, torch.is_autocast_enabled("cpu")

    coder = Coder()
    set_mixed_precision(coder, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, autocast_on = coder.decode(torch.ones(2, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and autocast_on is False


def test_force_fp32_keeps_gradients() -> None:
    head = Head()
    set_mixed_precision(head, torch.bfloat16)
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = head.loss(head(x).to(torch.bfloat16), torch.zeros(2, 4))
    loss.backward()
    assert head.linear.weight.grad is not None and head.linear.weight.grad.dtype == torch.float32
    assert head.linear.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------- wrap_method


def _twin_linears() -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    wrapped, plain = nn.Linear(4, 3), nn.Linear(4, 3)
    plain.load_state_dict(wrapped.state_dict())
    return wrapped, plain


def test_wrap_method_fp32_on_module_forward() -> None:
    lin, plain = _twin_linears()
    set_mixed_precision(lin, torch.bfloat16)
    set_mixed_precision(plain, torch.bfloat16)
    wrap_method(lin, "forward", "fp32")
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lin(x.to(torch.bfloat16))
        other = plain(x.to(torch.bfloat16))
    assert out.dtype == torch.float32 and other.dtype == torch.bfloat16
    assert torch.equal(out, torch.nn.functional.linear(x.to(torch.bfloat16).float(), lin.weight, lin.bias))
    # only this instance: the class and the twin are untouched
    assert "forward" not in vars(plain) and nn.Linear.forward is not lin.forward
    assert getattr(lin.forward, REGION_ATTR) == "fp32"
    assert list(inspect.signature(lin.forward).parameters) == ["input"]

    set_mixed_precision(lin, None)  # checked per call: now a no-op
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin(x).dtype == torch.bfloat16


def test_wrap_method_fp32_outputs_runs_as_usual_then_casts() -> None:
    lin, plain = _twin_linears()
    set_mixed_precision(lin, torch.bfloat16)
    wrap_method(lin, "forward", "fp32_outputs")
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lin(x)
        expected = plain(x)
    assert expected.dtype == torch.bfloat16
    assert out.dtype == torch.float32 and torch.equal(out, expected.float())


def test_wrap_method_gradients_reach_parameters() -> None:
    for mode in ("fp32", "fp32_outputs"):
        lin, _ = _twin_linears()
        set_mixed_precision(lin, torch.bfloat16)
        wrap_method(lin, "forward", mode)
        x = torch.randn(2, 4, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lin(x.to(torch.bfloat16)).sum().backward()
        assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0, mode
        assert x.grad is not None and x.grad.dtype == torch.float32, mode


def test_wrap_method_is_idempotent_and_unwrap_restores() -> None:
    lin, _ = _twin_linears()
    set_mixed_precision(lin, torch.bfloat16)
    wrap_method(lin, "forward", "fp32")
    first = lin.forward
    wrap_method(lin, "forward", "fp32")
    assert lin.forward is first and first.function is nn.Linear.forward  # not wrapped twice
    with pytest.raises(ValueError, match=r"mode='fp32'.*unwrap_method"):
        wrap_method(lin, "forward", "fp32_outputs")

    unwrap_method(lin, "forward")
    assert "forward" not in vars(lin) and lin.forward.__func__ is nn.Linear.forward
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin(torch.randn(2, 4)).dtype == torch.bfloat16
    unwrap_method(lin, "forward")  # not wrapped: no-op


def test_wrap_method_on_plain_object_and_instance_level_callables() -> None:
    class Coder:
        def decode(self, deltas: torch.Tensor) -> tuple[torch.Tensor, bool]:
            return deltas * 2, torch.is_autocast_enabled("cpu")

    coder, other = Coder(), Coder()
    set_mixed_precision(coder, torch.float16)
    set_mixed_precision(other, torch.float16)
    wrap_method(coder, "decode", "fp32")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, autocast_on = coder.decode(torch.ones(2, dtype=torch.float16))
        plain_out, plain_autocast_on = other.decode(torch.ones(2, dtype=torch.float16))
    assert out.dtype == torch.float32 and autocast_on is False
    assert plain_out.dtype == torch.float16 and plain_autocast_on is True
    assert "decode" not in vars(other) and getattr(Coder.decode, REGION_ATTR, None) is None

    # a callable stored on the instance is wrapped too and put back on unwrap
    def override(deltas: torch.Tensor) -> torch.Tensor:
        return deltas.to(torch.bfloat16)

    other.decode = override  # type: ignore[method-assign]
    wrap_method(other, "decode", "fp32_outputs")
    assert other.decode(torch.ones(1)).dtype == torch.float32
    unwrap_method(other, "decode")
    assert other.decode is override


def test_wrap_method_unknown_name_and_bad_mode() -> None:
    with pytest.raises(AttributeError, match=r"Linear.*'nope'"):
        wrap_method(nn.Linear(1, 1), "nope", "fp32")
    with pytest.raises(AttributeError, match=r"Linear.*'in_features'"):
        wrap_method(nn.Linear(1, 1), "in_features", "fp32")
    with pytest.raises(ValueError, match=r"\bmode\b.*'fp16'"):
        wrap_method(nn.Linear(1, 1), "forward", "fp16")  # type: ignore[arg-type]


def test_wrapped_module_survives_deepcopy_and_pickle() -> None:
    lin, _ = _twin_linears()
    set_mixed_precision(lin, torch.bfloat16)
    wrap_method(lin, "forward", "fp32")
    for clone in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
        assert clone.forward.owner is clone  # the copy calls itself, not the original
        with torch.no_grad():
            clone.weight.zero_()
            clone.bias.zero_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = clone(torch.ones(1, 4, dtype=torch.bfloat16))
        assert out.dtype == torch.float32 and torch.equal(out, torch.zeros(1, 3))
        unwrap_method(clone, "forward")
        assert "forward" not in vars(clone)


# ---------------------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("fullgraph", [False, True])
def test_regions_under_torch_compile(fullgraph: bool) -> None:
    # fullgraph=True additionally proves the regions trace without graph breaks
    torch._dynamo.reset()
    head = Head()
    set_mixed_precision(head, torch.bfloat16)
    lin, _ = _twin_linears()
    set_mixed_precision(lin, torch.bfloat16)
    wrap_method(lin, "forward", "fp32")

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        score = head(x).to(torch.bfloat16)
        return head.loss(score, score), head.decode(score, score), lin(score)

    compiled = torch.compile(step, backend="eager", fullgraph=fullgraph)
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, decoded, projected = compiled(x)
        seen_compiled = dict(head.seen)
        eager = step(x)
    assert seen_compiled["loss"] == (torch.float32, torch.float32, False, torch.float32)
    assert seen_compiled["forward"] == (torch.bfloat16, True, None)
    assert (loss.dtype, decoded.dtype, projected.dtype) == (torch.float32, torch.bfloat16, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip((loss, decoded, projected), eager, strict=True))
    torch._dynamo.reset()
