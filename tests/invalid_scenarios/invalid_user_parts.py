"""A user's own parts, named by the invalid scenarios next to it: each scenario gets one name wrong."""

from __future__ import annotations

from typing import Any

from gym_resilience import Task


def make_env(task: Task) -> Any:
    raise NotImplementedError("never built: the scenarios naming it are invalid")


def load_tasks() -> list[Task]:
    return [Task(prompt=[{"role": "user", "content": "hi"}], instance_id="only")]


def load_nothing() -> list[Task]:
    return []


def load_broken() -> list[Task]:
    raise OSError("the dataset is not mounted")


NOT_CALLABLE = 3
