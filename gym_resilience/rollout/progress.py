"""Where a rollout is (phase, turn, time per side), and how code running inside it can tell."""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field

from gym_resilience.errors import Phase
from gym_resilience.rollout_header import ROLLOUT_HEADER, RolloutIdentity, format_rollout_header

__all__ = ["Progress", "current_rollout", "rollout_headers"]


@dataclass
class Progress:
    """Where a rollout is, so a failure can say so: phase, turn, and time spent per side.

    ``attempt`` counts from 0; a retried rollout starts again with a fresh ``Progress``. ``node_id`` is
    the Ray node its env runs on, once the env is built (None for envs on this machine).
    """

    rollout_index: int
    attempt: int = 0
    phase: Phase = "reset"
    turn: int | None = None
    started: float = field(default_factory=time.perf_counter)
    llm_s: float = 0.0
    env_s: float = 0.0
    node_id: str | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


_CURRENT: contextvars.ContextVar[Progress | None] = contextvars.ContextVar(
    "gym_resilience_rollout", default=None
)


def enter_rollout(progress: Progress) -> None:
    """Make ``progress`` the calling context's rollout (the agent loop's task, and its env calls)."""
    _CURRENT.set(progress)


def current_rollout() -> Progress | None:
    """The rollout the calling code runs in (index, attempt, phase, turn), or None outside one.

    Set for the engine call and for every env call of a rollout (they run in its context), so an env,
    an engine wrapper or a log line can tell which rollout it serves.
    """
    return _CURRENT.get()


def rollout_headers() -> dict[str, str]:
    """The ``x-gym-resilience-rollout`` header for the rollout the caller runs in; empty outside one.

    Pass it to an HTTP client (``OpenAIEngine(..., headers=rollout_headers)``) so that a fault proxy can
    target network faults by rollout, attempt and turn.
    """
    progress = _CURRENT.get()
    if progress is None:
        return {}
    identity = RolloutIdentity(progress.rollout_index, progress.attempt, progress.turn)
    return {ROLLOUT_HEADER: format_rollout_header(identity)}
