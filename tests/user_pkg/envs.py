"""A small text env of the user's own: guess the task's word; one reward per step that contains it."""

from __future__ import annotations

from typing import Any

import gymnasium

from gym_resilience import Task

ChatMessages = list[dict[str, str]]


class GuessWordEnv(gymnasium.Env[ChatMessages, str]):
    """Each step answers whether the model's text contains ``env_kwargs["word"]``; ``turns`` steps end it."""

    def __init__(self, word: str, turns: int) -> None:
        self.word = word
        self.turns = turns
        self.steps = 0
        self.closed = False

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[ChatMessages, dict[str, Any]]:
        super().reset(seed=seed)
        task: Task = (options or {})["task"]
        self.steps = 0
        return [dict(message) for message in task.prompt], {}

    def step(self, action: str) -> tuple[ChatMessages, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        found = self.word in action
        reply = [{"role": "user", "content": "found it" if found else f"no {self.word} there, try again"}]
        return reply, float(found), found, self.steps >= self.turns, {}

    def close(self) -> None:
        self.closed = True


def make_env(task: Task) -> GuessWordEnv:
    """The env factory a scenario names: ``batch.env: <package>.envs:make_env``."""
    return GuessWordEnv(word=str(task.env_kwargs["word"]), turns=int(task.env_kwargs["turns"]))
