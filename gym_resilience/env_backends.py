"""Where a rollout's env runs: the one place that turns ``RunnerConfig``'s env backend into an env."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import gymnasium

from gym_resilience.config import RunnerConfig
from gym_resilience.env import ResilientEnv
from gym_resilience.isolation import IsolatedEnv, StartAbort
from gym_resilience.tasks import Task

__all__ = ["EnvFactory", "make_env"]

EnvFactory = Callable[[Task], gymnasium.Env[Any, Any]]
"""``env_factory(task)`` builds the env of one rollout."""


def make_env(
    env_factory: EnvFactory, task: Task, config: RunnerConfig, abort: StartAbort | None = None
) -> ResilientEnv[Any, Any]:
    """The env of one rollout, wrapped; in its own process when ``config.isolate_envs``, which
    ``abort`` can kill while it starts."""
    if config.isolate_envs:
        isolated = IsolatedEnv(
            functools.partial(env_factory, task),
            step_timeout=config.env_step_timeout_s,
            reset_timeout=config.env_reset_timeout_s,
            start_timeout=config.env_create_timeout_s,
            close_timeout=config.close_timeout_s,
            abort=abort,
        )
        return ResilientEnv(isolated)
    raw = env_factory(task)
    return raw if isinstance(raw, ResilientEnv) else ResilientEnv(raw)
