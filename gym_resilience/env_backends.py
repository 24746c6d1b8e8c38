"""Deprecated: :mod:`gym_resilience.backends.choice` chooses where a rollout's env runs now.

``make_env`` here still returns the wrapped env; :func:`gym_resilience.backends.choice.make_env` returns a
``BackendEnv`` that also says how the env is called.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from gym_resilience._moved import forward
from gym_resilience.backends.choice import make_env as _make_env

if TYPE_CHECKING:
    from gym_resilience.backends.choice import EnvFactory
    from gym_resilience.backends.protocol import StartAbort
    from gym_resilience.backends.resilient import ResilientEnv
    from gym_resilience.config import RunnerConfig
    from gym_resilience.tasks import Task

__getattr__ = forward(__name__, "gym_resilience.backends.choice")


def make_env(
    env_factory: EnvFactory, task: Task, config: RunnerConfig, abort: StartAbort | None = None
) -> ResilientEnv[Any, Any]:
    """Deprecated: ``gym_resilience.backends.choice.make_env(...).env``."""
    warnings.warn(
        "gym_resilience.env_backends.make_env is gym_resilience.backends.choice.make_env(...).env now",
        DeprecationWarning,
        stacklevel=2,
    )
    return _make_env(env_factory, task, config, abort).env
