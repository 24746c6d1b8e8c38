"""Deprecated: the vLLM server helper is :mod:`gym_resilience.engines.vllm_server` now.

Every name still resolves here, with a ``DeprecationWarning`` naming its new place; ``aservers`` is
``servers``, whose pool works with ``with`` and ``async with`` alike.
"""

from __future__ import annotations

import warnings
from typing import Any

from gym_resilience.engines import vllm_server

_RENAMED = {"aservers": "servers"}


def __getattr__(name: str) -> Any:
    new_name = _RENAMED.get(name, name)
    if name.startswith("__") or not hasattr(vllm_server, new_name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"gym_resilience.engines.servers.{name} is gym_resilience.engines.vllm_server.{new_name} now",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(vllm_server, new_name)
