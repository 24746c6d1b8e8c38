"""ScriptableEnv behaviours that tests/test_ray_backend.py passes to envs in Ray actors.

Other tests say how an env misbehaves with :class:`doubles.Fault`; these stay until the Ray tests do too.
They live in an importable module (not in a test file) because an actor unpickles them by reference.
"""

from __future__ import annotations

import time
from typing import Any

from doubles import HANG_S, SandboxError

from gym_resilience.testing import ScriptableEnv


def hang(*_args: Any) -> Any:
    """Never returns (in practice): a stuck tool call, a deadlocked simulator."""
    time.sleep(HANG_S)


def raise_value_error(env: ScriptableEnv, action: Any) -> Any:
    raise ValueError(f"bad move {action!r}")


def raise_unpicklable(env: ScriptableEnv, action: Any) -> Any:
    raise SandboxError("container 3f2a is gone")
