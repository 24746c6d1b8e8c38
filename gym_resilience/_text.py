"""How a value is named in an error message: the one rendering shared by the library and the harness."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["show"]


def show(value: Any) -> str:
    """A value as YAML or JSON data writes it: ``'three'``, ``3``, ``true``, ``null``, ``a list``.

    Anything data cannot hold is named by its type (``a tuple``, ``a function``); a long string is cut.
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else ".inf" if value > 0 else "-.inf"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:57] + "...")
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"
