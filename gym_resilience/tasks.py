"""A task: one prompt of a batch, handed to the env factory and to the env's ``reset``."""

from __future__ import annotations

from collections.abc import Mapping
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
