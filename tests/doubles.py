"""The test env double, its ledger, and the one way to inject a fault into it.

``factory(counts, *faults)`` builds :class:`CountingTextEnv` envs, each counted in ``counts`` (an
:class:`EnvCounts`: built, being built, closed, closed twice). A :class:`Fault` says where an env fails
(phase, tasks, turn, attempt) and how (sleep, then raise); it is plain data, so it pickles into an isolated
env's worker as it is. ``fail_on(...)`` is the short way to write one.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import gymnasium
from gymnasium import spaces

from gym_resilience import Task

SETTLE_S = 10.0
"""How long a test waits for envs to wind down: generous, it only bounds a failure."""


@dataclasses.dataclass
class EnvCounts:
    """Envs built, being built and closed across a batch, thread-safe, so tests can check nothing leaked.

    ``closes`` counts the closes of each env by its number; ``building`` the factories running right now.
    """

    created: int = 0
    building: int = 0
    closes: dict[int, int] = dataclasses.field(default_factory=dict)
    _changed: threading.Condition = dataclasses.field(default_factory=threading.Condition)

    def building_one(self, delta: int) -> None:
        with self._changed:
            self.building += delta
            self._changed.notify_all()

    def created_one(self) -> int:
        """Count a new env; its number."""
        with self._changed:
            number = self.created
            self.created += 1
            self.closes[number] = 0
            self._changed.notify_all()
            return number

    def closed_one(self, number: int) -> None:
        with self._changed:
            self.closes[number] += 1
            self._changed.notify_all()

    @property
    def closed(self) -> int:
        """Envs closed at least once."""
        return sum(1 for count in self.closes.values() if count >= 1)

    @property
    def open(self) -> int:
        """Envs built and never closed."""
        return self.created - self.closed

    def closed_more_than_once(self) -> int:
        return sum(1 for count in self.closes.values() if count > 1)

    def wait_for(self, predicate: Callable[[EnvCounts], bool], timeout_s: float = SETTLE_S) -> bool:
        """Wait until ``predicate(self)`` holds, at most ``timeout_s``; whether it does."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout_s)


@dataclasses.dataclass(frozen=True)
class Fault:
    """A failure of the envs of ``instances`` (every task's when None) in ``phase``, on ``turn`` (a step's
    0-based turn; any when None) of ``attempt`` (any when None): sleep ``sleep_s``, then raise ``error``.

    ``phase`` is ``"build"`` (in the factory), ``"reset"``, ``"step"`` or ``"close"`` (after the close
    is counted). Plain data: it pickles into a worker process as it is.
    """

    instances: frozenset[str] | None = None
    phase: str = "step"
    turn: int | None = 1
    attempt: int | None = None
    error: type[BaseException] | None = ValueError
    message: str | None = None
    sleep_s: float = 0.0

    def fire(self, phase: str, instance_id: str, turn: int, attempt: int) -> None:
        """Fail here if this is the fault's place; return to let the call through."""
        if phase != self.phase or (self.instances is not None and instance_id not in self.instances):
            return
        if (self.turn is not None and turn != self.turn) or (self.attempt not in (None, attempt)):
            return
        time.sleep(self.sleep_s)
        if self.error is not None:
            raise self.error(self.message or f"injected {phase} failure in {instance_id} at turn {turn}")


def fail_on(
    instance_ids: Collection[str] | None,
    phase: str = "step",
    turn: int | None = 1,
    exc: type[BaseException] | None = ValueError,
    **more: Any,
) -> Fault:
    """A :class:`Fault` raising ``exc`` (None: none, after ``sleep_s``) in ``phase`` on ``turn``."""
    instances = None if instance_ids is None else frozenset(instance_ids)
    return Fault(instances=instances, phase=phase, turn=turn, error=exc, **more)


class CountingTextEnv(gymnasium.Env[list[dict[str, str]], str]):
    """A multi-turn text env: echoes the turn number, rewards by the action's length, ends after ``turns``."""

    def __init__(self, task: Task, counts: EnvCounts, faults: Collection[Fault] = (), turns: int = 3) -> None:
        self.task = task
        self.counts = counts
        self.faults = tuple(faults)
        self.turns = turns
        self.turn = 0
        self.attempt = 0
        self.observation_space = spaces.Text(4096)  # type: ignore[assignment]
        self.action_space = spaces.Text(4096)
        self.number = counts.created_one()

    def _faults(self, phase: str, turn: int) -> None:
        for fault in self.faults:
            fault.fire(phase, self.task.instance_id, turn, self.attempt)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[dict[str, str]], dict[str, Any]]:
        super().reset(seed=seed)
        self.turn = 0
        self.attempt = (options or {}).get("attempt", 0)
        self._faults("reset", 0)
        return list(self.task.prompt), {}

    def step(self, action: str) -> tuple[list[dict[str, str]], float, bool, bool, dict[str, Any]]:
        self._faults("step", self.turn)
        self.turn += 1
        reward = (len(action) % 5) / 4
        observation = [{"role": "user", "content": f"turn {self.turn} done"}]
        return observation, reward, self.turn >= self.turns, False, {"turn": self.turn}

    def close(self) -> None:
        self.counts.closed_one(self.number)
        self._faults("close", self.turn)


def factory(
    counts: EnvCounts,
    *faults: Fault,
    turns: int = 3,
    env: type[CountingTextEnv] = CountingTextEnv,
    delay: Callable[[Task], None] | None = None,
) -> Callable[[Task], CountingTextEnv]:
    """An env factory of ``env`` envs counted in ``counts``, failing where ``faults`` say.

    ``delay(task)`` runs first in the factory (a gate a test opens, a slow sandbox); ``"build"`` faults
    fire after it. ``counts.building`` counts the factories running meanwhile.
    """

    def build(task: Task) -> CountingTextEnv:
        counts.building_one(1)
        try:
            if delay is not None:
                delay(task)
            for fault in faults:
                fault.fire("build", task.instance_id, 0, 0)
            return env(task, counts, faults, turns)
        finally:
            counts.building_one(-1)

    return build


def tasks(n: int, prefix: str = "t") -> list[Task]:
    return [
        Task(
            prompt=[{"role": "user", "content": f"task number {i}, please answer"}],
            instance_id=f"{prefix}{i}",
        )
        for i in range(n)
    ]
