"""The env ledger: every env a run builds reports its creation and its close to the run's recorder.

Reported from whichever thread or process builds the env (isolated worker processes and Ray actors
included), so the recorder (``harness.run.recorder``) counts every env. An env of a worker that was
killed (a hung env past its deadline) never reports its close; it counts as closed once its process is
gone.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any

import gymnasium

from gym_resilience import Task
from harness.faults.events import RunEvents

__all__ = ["LedgeredFactory"]


class _LedgeredEnv(gymnasium.Wrapper[Any, Any, Any, Any]):
    def __init__(self, env: gymnasium.Env[Any, Any], events: RunEvents) -> None:
        super().__init__(env)
        self._events = events
        self._id = uuid.uuid4().hex
        events.env_opened(self._id, os.getpid())

    def close(self) -> None:
        try:
            self.env.close()
        finally:
            self._events.env_closed(self._id, os.getpid())


@dataclass(frozen=True)
class LedgeredFactory:
    """Wraps an env factory so every env it builds reports its creation and close. Picklable."""

    factory: Any
    events: RunEvents

    def __call__(self, task: Task) -> gymnasium.Env[Any, Any]:
        return _LedgeredEnv(self.factory(task), self.events)
