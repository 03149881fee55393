"""The one error type the library raises for a bad argument value, so the command line can name its config
path.

Library code knows the name of the argument it was given (``frozen_stages``, ``backbone.name``), not where a
config file put it. It raises :class:`ArgumentError` naming the argument; :mod:`lit_amp_det.app` knows which
config node it instantiated and re-raises the same error with the node's path in front
(``callbacks.freeze_norm. frozen_stages``), so a research script calling the class and a command-line user
each read the name they typed.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["ArgumentError"]


class ArgumentError(ValueError):
    """``argument`` got ``value``, which ``problem`` explains (with what to pass instead); the message reads
    ``<argument>=<value!r> <problem>``. ``argument`` is dotted for a value inside a mapping argument
    (``backbone.name``); a caller that passed the mapping re-raises with :meth:`at`. Subclasses keep the
    constructor's signature (pickling and :meth:`at` rely on it).
    """

    def __init__(self, argument: str, value: Any, problem: str) -> None:
        self.argument, self.value, self.problem = argument, value, problem
        super().__init__(f"{argument}={value!r} {problem}")

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across DDP / multiprocessing with all three fields
        return (type(self), (self.argument, self.value, self.problem))

    def at(self, prefix: str) -> ArgumentError:
        """The same error (same type), its argument named from ``prefix`` (a config node such as
        ``model``).
        """
        moved = copy.copy(self)
        moved.argument = f"{prefix}.{self.argument}" if prefix else self.argument
        moved.args = (f"{moved.argument}={self.value!r} {self.problem}",)
        return moved
