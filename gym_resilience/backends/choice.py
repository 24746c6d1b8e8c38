"""Where a rollout's env runs: the one place that turns ``RunnerConfig.env_backend`` into an env.

``"thread"``: ``env_factory(task)`` in this process (the runner's pool runs its calls); ``"process"``: an
:class:`~gym_resilience.backends.process.IsolatedEnv`, in a worker process; ``"ray"``: a
:class:`~gym_resilience.backends.ray.RayEnv`, in a Ray actor on the cluster this process is connected to.
The last two keep the config's env deadlines by killing the worker, and ``abort`` can kill it while the env
starts; their workers come from the runner's pool (:func:`env_workers`, ``backends/pool.py``).
:func:`make_env` says which it chose in a :class:`BackendEnv`, so that the rollout never has to ask the env
again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium

from gym_resilience.backends.pool import WorkerPool
from gym_resilience.backends.protocol import StartAbort, WorkerEnv, checked_env
from gym_resilience.backends.resilient import ResilientEnv
from gym_resilience.config import RunnerConfig
from gym_resilience.errors import describe_exception
from gym_resilience.tasks import Task

__all__ = ["BackendEnv", "EnvFactory", "env_workers", "make_env"]

EnvFactory = Callable[[Task], gymnasium.Env[Any, Any]]
"""``env_factory(task)`` builds the env of one rollout."""


@dataclass(frozen=True, slots=True)
class BackendEnv:
    """A rollout's env and how it is called.

    ``remote``: the env lives in a worker process or a Ray actor, whose close kills it even mid-call, so
    the close runs beside a stuck call instead of queueing behind it, and its reset is a call of its own.
    """

    env: ResilientEnv[Any, Any]
    remote: bool
    worker: WorkerEnv | None = None

    @property
    def node_id(self) -> str | None:
        """The Ray node the env's actor runs on (None for an env on this machine, or a node not known yet)."""
        node = getattr(self.worker, "node_id", None)
        return node if isinstance(node, str) else None


def make_env(
    env_factory: EnvFactory,
    task: Task,
    config: RunnerConfig,
    abort: StartAbort | None = None,
    workers: WorkerPool[Any] | None = None,
) -> BackendEnv:
    """The env of one rollout, wrapped, where ``config.env_backend`` says; ``abort`` can kill a worker
    process or actor while it starts. ``workers`` (see :func:`env_workers`) lends the env a worker;
    without one it gets a worker of its own.

    The wrappers made here leave a failed env open (``close_on_error=False``): the rollout closes it in
    its teardown, under ``close_timeout_s``, so the close is never part of the failed call (and of the
    rollout's deadline)."""
    if config.env_backend == "thread":
        return _local(checked_env(env_factory(task), env_factory))
    env_fn = functools.partial(env_factory, task)
    deadlines: dict[str, Any] = {
        "step_timeout": config.env_step_timeout_s,
        "reset_timeout": config.env_reset_timeout_s,
        "start_timeout": config.env_create_timeout_s,
        "close_timeout": config.close_timeout_s,
        "abort": abort,
        "workers": workers,
    }
    worker: WorkerEnv
    if config.env_backend == "process":
        from gym_resilience.backends.process import IsolatedEnv

        worker = IsolatedEnv(env_fn, **deadlines)
    else:
        from gym_resilience.backends.ray import RayEnv  # imports ray only when it is used

        options = config.env_actor_options if workers is None else None  # else the pool's
        worker = RayEnv(env_fn, actor_options=options, **deadlines)
    return BackendEnv(ResilientEnv(worker, close_on_error=False), remote=True, worker=worker)


def env_workers(config: RunnerConfig) -> WorkerPool[Any] | None:
    """The pool of worker processes or actors of a runner with ``config`` (None: envs on threads).
    Nothing starts until an env needs a worker (or :meth:`WorkerPool.prestart`)."""
    size, reuse = config.env_pool_size, config.env_worker_reuse
    if config.env_backend == "process":
        from gym_resilience.backends.process import process_workers

        return process_workers(size=size, reuse=reuse, grace_s=config.close_timeout_s)
    if config.env_backend == "ray":
        from gym_resilience.backends.ray import ray_workers

        return ray_workers(config.env_actor_options, size=size, reuse=reuse)
    return None


def _local(raw: gymnasium.Env[Any, Any]) -> BackendEnv:
    """A thread backend's env, wrapped unless it is a ResilientEnv already; what the factory built is
    closed if it cannot be wrapped. One the factory built in a worker of its own counts as remote."""
    env: ResilientEnv[Any, Any]
    if isinstance(raw, ResilientEnv):
        env = raw
    else:
        try:
            env = ResilientEnv(raw, close_on_error=False)
        except BaseException as exc:
            try:
                raw.close()
            except Exception as close_error:
                exc.add_note(
                    f"closing what env_factory returned also failed: {describe_exception(close_error)}"
                )
            raise
    worker = env.unwrapped if isinstance(env.unwrapped, WorkerEnv) else None
    return BackendEnv(env, remote=worker is not None, worker=worker)
