"""Where a rollout's env runs: the one place that turns ``RunnerConfig.env_backend`` into an env.

``"thread"``: ``env_factory(task)`` in this process (the runner's pool runs its calls); ``"process"``: an
:class:`~gym_resilience.isolation.IsolatedEnv`, a worker process of its own; ``"ray"``: a
:class:`~gym_resilience.ray_env.RayEnv`, a Ray actor of its own on the cluster this process is connected
to. The last two keep the config's env deadlines by killing the worker, and ``abort`` can kill it while
the env starts. Every env comes back wrapped in :class:`~gym_resilience.env.ResilientEnv`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import gymnasium

from gym_resilience.config import RunnerConfig
from gym_resilience.env import ResilientEnv
from gym_resilience.errors import describe_exception
from gym_resilience.isolation import IsolatedEnv, StartAbort, checked_env
from gym_resilience.tasks import Task
from gym_resilience.worker_env import WorkerEnv

__all__ = ["EnvFactory", "make_env"]

EnvFactory = Callable[[Task], gymnasium.Env[Any, Any]]
"""``env_factory(task)`` builds the env of one rollout."""


def make_env(
    env_factory: EnvFactory, task: Task, config: RunnerConfig, abort: StartAbort | None = None
) -> ResilientEnv[Any, Any]:
    """The env of one rollout, wrapped, where ``config.env_backend`` says; ``abort`` can kill a worker
    process or actor while it starts.

    The wrappers made here leave a failed env open (``close_on_error=False``): the rollout closes it in
    its teardown, under ``close_timeout_s``, so the close is never part of the failed call (and of the
    rollout's deadline)."""
    if config.env_backend == "thread":
        # No env: a TypeError, the same as a worker process's or an actor's (what was returned is closed).
        raw = checked_env(env_factory(task), env_factory)
        if isinstance(raw, ResilientEnv):
            return raw
        try:
            return ResilientEnv(raw, close_on_error=False)
        except BaseException as exc:  # an env ResilientEnv cannot wrap: what the factory built is closed
            try:
                raw.close()
            except Exception as close_error:
                exc.add_note(
                    f"closing what env_factory returned also failed: {describe_exception(close_error)}"
                )
            raise
    env_fn = functools.partial(env_factory, task)
    deadlines: dict[str, Any] = {
        "step_timeout": config.env_step_timeout_s,
        "reset_timeout": config.env_reset_timeout_s,
        "start_timeout": config.env_create_timeout_s,
        "close_timeout": config.close_timeout_s,
        "abort": abort,
    }
    worker: WorkerEnv
    if config.env_backend == "process":
        worker = IsolatedEnv(env_fn, **deadlines)
    else:
        from gym_resilience.ray_env import RayEnv  # imports ray only when it is used

        worker = RayEnv(env_fn, actor_options=config.env_actor_options, **deadlines)
    return ResilientEnv(worker, close_on_error=False)
