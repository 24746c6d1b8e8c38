"""Env factories that take their time, for isolated envs: a worker process imports them by name.

They live in an importable module, as ``worker_envs`` does, because a forkserver worker unpickles a factory
by reference, importing its module from the ``sys.path`` the fork server started with.
"""

from __future__ import annotations

import time
from typing import Any

from gym_resilience.testing import ScriptableEnv


def build_unless_stuck(task: Any) -> ScriptableEnv:
    """A batch runner env factory that never returns for a task marked ``{"stuck_building": True}``."""
    if task.env_kwargs.get("stuck_building"):
        time.sleep(10**6)
    return ScriptableEnv()
