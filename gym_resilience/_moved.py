"""Old module paths kept importable: a module that moved forwards its names with a DeprecationWarning."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["forward"]


def forward(old: str, *new: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the old module ``old``: each name resolves from the first of the
    modules ``new`` that has it, with a ``DeprecationWarning`` naming where it lives now."""

    def __getattr__(name: str) -> Any:
        if not name.startswith("__"):
            for module_name in new:
                module = importlib.import_module(module_name)
                if hasattr(module, name):
                    value = getattr(module, name)
                    # A name imported into one of them is named where it is defined.
                    home = getattr(value, "__module__", None)
                    home = home if home in new else module_name
                    warnings.warn(f"{old}.{name} is {home}.{name} now", DeprecationWarning, stacklevel=2)
                    return value
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
