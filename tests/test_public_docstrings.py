"""The public API documents itself as torchvision's does: every public function and class constructor in a
package's ``__all__`` names each argument under ``Args:`` and, when it returns a value, says what under
``Returns:``; a multi-line docstring closes on its own line.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Callable, Iterator

import pytest

#: the packages whose ``__all__`` is the public API a user reads
PUBLIC_PACKAGES = (
    "lit_amp_det",
    "lit_amp_det.ops",
    "lit_amp_det.models",
    "lit_amp_det.data",
    "lit_amp_det.callbacks",
    "lit_amp_det.precision",
    "lit_amp_det.optim",
)


def _public_callables() -> Iterator[tuple[str, Callable]]:
    for package in PUBLIC_PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isclass(value) or inspect.isfunction(value):
                yield f"{package}.{name}", value


def _documented_callable(value: Callable) -> tuple[Callable, str]:
    """The callable whose parameters a user passes, and the docstring that describes them."""
    if not inspect.isclass(value):
        return value, inspect.getdoc(value) or ""
    own_init = "__init__" in vars(value)
    docs = [inspect.getdoc(value) or ""]
    if own_init:
        docs.append(inspect.getdoc(value.__init__) or "")
    return (value.__init__ if own_init else value), "\n".join(docs)


def _parameters(target: Callable) -> list[str]:
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    return [
        name
        for name, parameter in signature.parameters.items()
        if name not in ("self", "cls")
        and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    ]


def _returns_value(target: Callable) -> bool:
    if inspect.isclass(target) or target.__name__ == "__init__":
        return False
    annotation = inspect.signature(target).return_annotation
    return annotation not in (inspect.Signature.empty, None, "None")


CALLABLES = dict(_public_callables())


@pytest.mark.parametrize("name", sorted(CALLABLES))
def test_public_callable_has_args_returns_sections(name: str) -> None:
    value = CALLABLES[name]
    target, doc = _documented_callable(value)
    assert doc, f"{name} has no docstring"
    parameters = _parameters(target)
    if parameters:
        assert re.search(r"^Args:$", doc, re.M), f"{name}: no Args: section for {parameters}"
        for parameter in parameters:
            assert re.search(rf"^\s+\**{parameter}\b", doc, re.M), (
                f"{name}: Args: does not describe {parameter!r}"
            )
    if _returns_value(target):
        assert re.search(r"^(Returns|Yields):$", doc, re.M), f"{name}: no Returns: section"


@pytest.mark.parametrize("name", sorted(CALLABLES))
def test_public_docstring_closes_on_its_own_line(name: str) -> None:
    value = CALLABLES[name]
    source = inspect.getsource(value)
    indent = len(source) - len(source.lstrip())
    node = ast.parse("\n".join(line[indent:] for line in source.splitlines())).body[0]
    docstring = node.body[0] if node.body and isinstance(node.body[0], ast.Expr) else None
    assert docstring is not None and isinstance(docstring.value, ast.Constant), f"{name} has no docstring"
    lines = source.splitlines()[docstring.lineno - 1 : docstring.end_lineno]
    if len(lines) > 1:
        assert lines[-1].strip() in ('"""', "'''"), f"{name}: the docstring's closing quotes follow text"
