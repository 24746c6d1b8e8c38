"""The env actor of the Ray backend: the class Ray runs in an actor's process, which builds one env after
another from its factory and answers the runner's calls to it (:mod:`gym_resilience.backends.ray` drives
it from the runner's side)."""

from __future__ import annotations

import functools
from typing import Any

import gymnasium

from gym_resilience.backends.baseline import WorkerBaseline, become_subreaper
from gym_resilience.backends.protocol import EnvFn, answer_ending, open_env
from gym_resilience.errors import DependencyNotInstalledError

__all__ = ["RAY_EXTRA", "host_class", "ray_module"]

RAY_EXTRA = "'gym-resilience[ray]'"
"""The extra that installs ray."""


def ray_module() -> Any:
    """The ``ray`` module, connected or not.

    Raises:
        DependencyNotInstalledError: ray is not installed.
    """
    try:
        import ray
    except ImportError as exc:
        raise DependencyNotInstalledError(package="ray", extra=RAY_EXTRA) from exc
    return ray


class _EnvHost:
    """The actor that holds one env after another; every method answers with a pickled reply and never
    raises. After each env it checks what the env left behind (:class:`WorkerBaseline`)."""

    def __init__(self, reuse: bool = False) -> None:
        self._env: gymnasium.Env[Any, Any] | None = None
        # A daemon its env double-forks stays below the actor, so that Ray's end of the actor's process
        # (it kills that process's children) ends it too; a reused actor counts it as a leftover.
        become_subreaper()
        # Open files are not compared: Ray's own runtime in the actor's process opens connections (to other
        # workers, the object store) as it goes, which would retire nearly every actor after its first env.
        self._baseline = WorkerBaseline(open_files=False) if reuse else None

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def open(self, env_fn: EnvFn) -> bytes:
        self._env, reply = open_env(env_fn, self._baseline)
        return reply

    def call(self, request: bytes) -> bytes:
        if self._env is None:  # never: the parent only calls an env that started
            raise RuntimeError("the env was not built")
        reply, closed = answer_ending(self._env, request, self._baseline)
        if closed:
            self._env = None
        return reply


@functools.cache
def host_class() -> Any:
    """The env actor's class in Ray (no cluster needed until an actor is created)."""
    return ray_module().remote(_EnvHost)
