"""What the OpenAIEngine tests share: two endpoint URLs no server answers, a prompt, a vLLM completion's
JSON, and a wait for a condition."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

A, B = "http://a.test", "http://b.test"
PROMPT = [2, 100, 200, 300]
EOS = 3


def completion_json(prompt: list[int], token_ids: list[int], reason: str = "stop") -> dict[str, Any]:
    return {
        "choices": [
            {
                "token_ids": token_ids,
                "prompt_token_ids": prompt,
                "finish_reason": reason,
                "logprobs": {"token_logprobs": [-0.5] * len(token_ids)},
            }
        ]
    }


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0, what: str = "") -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {what}")
        await asyncio.sleep(0.005)
