"""A user's pipeline module whose function a scenario misspells."""

from typing import Any


async def generate(tasks: Any, env_factory: Any, engine: Any) -> list[Any]:
    return []
