"""What the tests of both vLLM engines share: a chat prompt, waiting for a condition, child processes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import psutil

from gym_resilience.engines.base import Engine

MESSAGES = [{"role": "user", "content": "Move left, then step 3."}]


def chat_prompt(engine: Engine) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert isinstance(ids, list)
    return ids


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.001)):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"not true within {timeout_s} s")


def child_pids() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}
