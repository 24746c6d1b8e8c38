"""What the tests of both vLLM engines share: a chat prompt, waiting for a condition, child processes and
engine threads, bad requests."""

from __future__ import annotations

import asyncio
import multiprocessing.resource_tracker
import re
import threading
from collections.abc import Callable
from typing import Any

import psutil
import pytest

from gym_resilience.engines.base import Engine, Sampling
from gym_resilience.errors import EngineRequestError

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


BAD_REQUESTS = [
    ("seed", [1, 2, 3], Sampling(max_tokens=4, temperature=1.0, seed=1.5), "seed must be None or an integer"),
    (
        "seed",
        [1, 2, 3],
        Sampling(max_tokens=4, temperature=1.0, seed=2**64),
        "seed must be None or an integer",
    ),
    ("max_tokens", [1, 2, 3], Sampling(max_tokens=2.5), "max_tokens must be an integer >= 1"),  # type: ignore[arg-type]
    ("ids", [1.5, 2.5], Sampling(max_tokens=4), "the prompt's token ids must be integers"),
    ("ids", "hello", Sampling(max_tokens=4), "the prompt's token ids must be integers"),
]
"""Requests vLLM would take on trust and fail later: a seed torch cannot hold in the engine's step (which
killed the engine), a value of the wrong type in the core's decoding (which hung the async engine)."""


async def a_bad_request_fails_alone(engine: Any, prompt: Any, sampling: Sampling, message: str) -> None:
    """``engine`` fails the request with an EngineRequestError saying ``message`` and answers the next,
    each within 30 s (an engine that stopped answering would hang the test otherwise)."""
    with pytest.raises(EngineRequestError, match=re.escape(message)):
        await asyncio.wait_for(engine.generate(prompt, sampling), 30)
    next_one = Sampling(max_tokens=4, temperature=1.0, seed=3)
    generation = await asyncio.wait_for(engine.generate(chat_prompt(engine), next_one), 30)
    assert len(generation.token_ids) == 4 and engine.is_running


def engine_threads() -> list[threading.Thread]:
    """The threads that step an in-process engine."""
    return [thread for thread in threading.enumerate() if thread.name == "gym-resilience-vllm"]


def resource_tracker_pid() -> int | None:
    """The pid of multiprocessing's resource tracker, if it runs. vLLM starts its engine process with
    `spawn`, which starts the tracker once per interpreter; it belongs to Python, lives until exit, and is
    no engine process."""
    tracker: Any = multiprocessing.resource_tracker._resource_tracker
    return tracker._pid


def leftovers(before: set[int]) -> set[int]:
    """Child processes of this one that were not there ``before`` (the resource tracker aside)."""
    return child_pids() - before - {resource_tracker_pid()}
