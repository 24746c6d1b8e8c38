"""The one check of a number of seconds given as an option: a deadline, a delay, an interval."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

from gym_resilience.errors import UnsupportedConfigError

__all__ = ["MAX_SECONDS", "check_seconds"]


MAX_SECONDS: Final = 2_147_483.0
"""The longest deadline or delay: a wait of the operating system (``poll``, a lock's timeout) counts
milliseconds in a 32-bit integer, and overflows past it."""


def check_seconds(
    option: str,
    value: object,
    *,
    allow_none: bool = True,
    allow_zero: bool = False,
    path: Sequence[str | int] | None = None,
) -> None:
    """Raise ``UnsupportedConfigError`` (naming ``option``) unless ``value`` is a finite number of seconds.

    Finite: an infinite deadline is no deadline (None says that where it is allowed), and a worker's
    cannot be one. ``allow_zero`` accepts 0 (a delay may be none); a deadline must be > 0. A bool is not
    a number here. ``path`` is the error's ``path`` (``(option,)`` unless given).
    """
    if value is None and allow_none:
        return
    if (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and (value > 0 or (allow_zero and value == 0))
    ):
        if value <= MAX_SECONDS:
            return
        forever = "; None for no deadline" if allow_none else ""
        raise UnsupportedConfigError(
            f"must be at most {MAX_SECONDS:,.0f} seconds (about 24 days, the longest wait the operating "
            f"system takes){forever}, got {value!r}",
            option=option,
            path=path,
        )
    expected = "None or a finite number" if allow_none else "a finite number"
    bound = ">= 0" if allow_zero else "> 0"
    raise UnsupportedConfigError(
        f"must be {expected} of seconds {bound}, got {value!r}", option=option, path=path
    )
