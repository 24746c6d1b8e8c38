"""How the output validator and the checks of engines' generations find a bad value in a row and show it
in an error.

Rows are checked with builtins that loop in C (``set(map(type, ...))``, ``min``, ``sum``); a Python loop
runs only to locate the bad entry once one is known to be there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Real
from typing import Any, Final

__all__ = [
    "equals",
    "first_bad_mask_value",
    "first_bad_number",
    "first_bad_token",
    "is_finite_real",
    "is_real",
    "show",
]

_MAX_SHOWN: Final = 60


def show(value: Any) -> str:
    """A bad value for an error: its repr, cut at 60 characters, and its type name unless a list."""
    text = repr(value)
    if len(text) > _MAX_SHOWN:
        text = text[: _MAX_SHOWN - 3] + "..."
    return text if isinstance(value, list) else f"{text} ({type(value).__name__})"


def is_real(value: Any) -> bool:
    """A real number: an int or float, or a ``numbers.Real`` that is not a bool."""
    return (
        type(value) is float
        or type(value) is int
        or (isinstance(value, Real) and not isinstance(value, bool))
    )


def is_finite_real(value: Any) -> bool:
    """A real number that is neither NaN nor infinite."""
    try:
        return is_real(value) and math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def equals(value: Any, expected: Any) -> bool:
    """``value == expected`` as one bool; False when ``==`` raises or gives no single bool."""
    try:
        return bool(value == expected)
    except Exception:  # a foreign row (a numpy array) whose == is not one bool; other checks report it
        return False


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_mask_value(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value in (0, 1)


def _is_logprob(value: Any) -> bool:
    return is_finite_real(value) and value <= 0


def _first_bad(values: list[Any], is_good: Callable[[Any], bool]) -> int | None:
    for index, value in enumerate(values):
        if not is_good(value):
            return index
    return None


def first_bad_token(ids: list[Any]) -> int | None:
    """The index of the first entry that is not a token id (an int >= 0, not a bool); None if all are."""
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0):
        return None
    return _first_bad(ids, _is_token_id)


def first_bad_mask_value(mask: list[Any]) -> int | None:
    """The index of the first entry that is not the int 0 or 1; None if all are."""
    # The type test matters: True == 1 and 1.0 == 1, so the value set alone would let them through.
    if not mask or (set(map(type, mask)) == {int} and set(mask) <= {0, 1}):
        return None
    return _first_bad(mask, _is_mask_value)


def first_bad_number(values: list[Any], *, at_most_zero: bool = False) -> int | None:
    """The index of the first entry that is not a finite real (<= 0 too with ``at_most_zero``: a logprob);
    None if all are."""
    if not values:
        return None
    try:
        # NaN and inf survive a sum; a sum that overflows only costs the slow path below.
        if (
            set(map(type, values)) <= {float, int}
            and math.isfinite(sum(values))
            and (not at_most_zero or max(values) <= 0)
        ):
            return None
    except OverflowError:
        pass
    return _first_bad(values, _is_logprob if at_most_zero else is_finite_real)
