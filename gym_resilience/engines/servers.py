"""Deprecated: the vLLM server helper is :mod:`gym_resilience.testing_servers` now.

Every name still resolves here, with a ``DeprecationWarning`` naming its new place; ``aservers`` is
``servers``, whose pool works with ``with`` and ``async with`` alike.
"""

from __future__ import annotations

import warnings
from typing import Any

from gym_resilience import testing_servers

_RENAMED = {"aservers": "servers"}


def __getattr__(name: str) -> Any:
    new_name = _RENAMED.get(name, name)
    if name.startswith("__") or not hasattr(testing_servers, new_name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"gym_resilience.engines.servers.{name} is gym_resilience.testing_servers.{new_name} now",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(testing_servers, new_name)
