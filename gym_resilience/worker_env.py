"""The base of envs that run out of this process: in a worker process, or in a Ray actor.

:class:`~gym_resilience.env.ResilientEnv` and the batch runner treat every :class:`WorkerEnv` alike: a
call past its deadline ends the worker, a worker that dies or is killed makes the env count as closed
(:attr:`WorkerEnv.lost` says why), and ``close`` may run beside a stuck call, since ending the worker
ends that call.
"""

from __future__ import annotations

import abc
from typing import Any, Protocol

import gymnasium

from gym_resilience.errors import EnvError

__all__ = ["Killable", "WorkerEnv"]


class Killable(Protocol):
    """Something a caller can end at once from another thread: a worker process, an actor."""

    def kill(self) -> None: ...


class WorkerEnv(gymnasium.Env[Any, Any], abc.ABC):
    """A local stand-in for an env that lives in a worker that a deadline can end."""

    @property
    @abc.abstractmethod
    def lost(self) -> EnvError | None:
        """The error that ended the worker (a timeout, its death, a close during a call), else None."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether the worker was closed, killed or lost."""
