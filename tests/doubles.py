"""A counting text env for runner tests: faults chosen per (phase, rollout, turn) by a callable."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium
from gymnasium import spaces

from gym_resilience import Task

Fault = Callable[[str, str, int], None]
"""``fault(phase, instance_id, turn)`` raises to inject a failure; returns to let the call through."""


def no_fault(phase: str, instance_id: str, turn: int) -> None:
    return None


@dataclass
class EnvLedger:
    """Counts env creations and closes across a batch, so tests can check nothing leaked."""

    created: int = 0
    closes: dict[int, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def open_envs(self) -> int:
        return self.created - sum(1 for count in self.closes.values() if count >= 1)

    def closed_more_than_once(self) -> int:
        return sum(1 for count in self.closes.values() if count > 1)


class CountingTextEnv(gymnasium.Env[list[dict[str, str]], str]):
    """A multi-turn text env: echoes the turn number, rewards by the action's length, ends after ``turns``."""

    def __init__(self, task: Task, ledger: EnvLedger, fault: Fault = no_fault, turns: int = 3) -> None:
        self.task = task
        self.ledger = ledger
        self.fault = fault
        self.turns = turns
        self.turn = 0
        self.observation_space = spaces.Text(4096)  # type: ignore[assignment]
        self.action_space = spaces.Text(4096)
        with ledger.lock:
            self.number = ledger.created
            ledger.created += 1
            ledger.closes[self.number] = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[dict[str, str]], dict[str, Any]]:
        super().reset(seed=seed)
        self.turn = 0
        self.fault("reset", self.task.instance_id, 0)
        return list(self.task.prompt), {}

    def step(self, action: str) -> tuple[list[dict[str, str]], float, bool, bool, dict[str, Any]]:
        self.fault("step", self.task.instance_id, self.turn)
        self.turn += 1
        reward = (len(action) % 5) / 4
        observation = [{"role": "user", "content": f"turn {self.turn} done"}]
        return observation, reward, self.turn >= self.turns, False, {"turn": self.turn}

    def close(self) -> None:
        with self.ledger.lock:
            self.ledger.closes[self.number] += 1


def factory(ledger: EnvLedger, fault: Fault = no_fault, turns: int = 3) -> Callable[[Task], CountingTextEnv]:
    return lambda task: CountingTextEnv(task, ledger, fault, turns)


def tasks(n: int, prefix: str = "t") -> list[Task]:
    return [
        Task(
            prompt=[{"role": "user", "content": f"task number {i}, please answer"}],
            instance_id=f"{prefix}{i}",
        )
        for i in range(n)
    ]


def fail_on(
    instance_ids: set[str], phase: str = "step", turn: int = 1, exc: type[BaseException] = ValueError
) -> Fault:
    def fault(p: str, instance_id: str, t: int) -> None:
        if p == phase and instance_id in instance_ids and t == turn:
            raise exc(f"injected {phase} failure in {instance_id} at turn {t}")

    return fault
