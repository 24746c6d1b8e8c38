"""A task: one prompt of a batch, handed to the env factory and to the env's ``reset``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ChatMessage", "Task"]

ChatMessage = dict[str, str]
"""One chat message: ``{"role": ..., "content": ...}``."""


@dataclass(frozen=True, slots=True)
class Task:
    """One prompt of a batch.

    ``prompt`` is the opening chat messages (the env may add to them on reset), ``instance_id`` names
    the task in trajectory ids, ``env_kwargs`` carries whatever the env needs (a seed, a target word).
    """

    prompt: list[ChatMessage]
    instance_id: str
    env_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Refuses a task the batch could only fail on later, naming the field.

        Raises:
            TypeError: ``prompt`` is not a list of chat messages (mappings), ``instance_id`` not a string,
                or ``env_kwargs`` not a mapping.
            ValueError: ``instance_id`` is empty.
        """
        prompt, instance_id, env_kwargs = self.prompt, self.instance_id, self.env_kwargs
        if isinstance(prompt, str | bytes | Mapping) or not (
            isinstance(prompt, Sequence) and all(isinstance(message, Mapping) for message in prompt)
        ):
            raise TypeError(
                'Task.prompt must be a list of chat messages ({"role": ..., "content": ...}), got '
                f"{type(prompt).__name__}: {prompt!r:.60}"
            )
        if not isinstance(instance_id, str):
            raise TypeError(
                f"Task.instance_id must be a str, got {type(instance_id).__name__}: {instance_id!r:.60}"
            )
        if not instance_id:
            raise ValueError("Task.instance_id must not be empty: it names the task's trajectories")
        if not isinstance(env_kwargs, Mapping):
            raise TypeError(
                f"Task.env_kwargs must be a mapping, got {type(env_kwargs).__name__}: {env_kwargs!r:.60}"
            )
