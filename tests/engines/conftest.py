"""The async engine the engine tests share: vLLM's async engine on the tiny model (the session's
``vllm_engine``, which ``make_vllm_engine`` makes an in-process one on CPU, is in ``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from gym_resilience.engines.vllm import VLLMEngine


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def async_engine(tiny_model: Path) -> AsyncIterator[VLLMEngine]:
    """vLLM's async engine, started once (about 20-30 s on CPU) for every test of this folder that asks
    for it, and closed when the session ends. Its core runs in a process of its own, so it does not
    stand in the way of an in-process engine a test starts."""
    async with VLLMEngine(tiny_model) as engine:
        yield engine
