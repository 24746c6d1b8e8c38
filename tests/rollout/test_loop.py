"""The agent loop's pure parts: a turn's reward in either shape, and the rollout deadline's error."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from gym_resilience import RolloutTimeoutError, RunnerConfig
from gym_resilience.rollout.loop import _reward, _within_rollout_deadline
from gym_resilience.rollout.progress import Progress


def test_a_trajectory_level_reward_is_the_float_itself() -> None:
    assert _reward(1.5, 4, token_level=False) == 1.5


def test_a_token_level_reward_sits_on_the_last_token_or_the_one_named() -> None:
    assert _reward(1.5, 4, token_level=True) == [0.0, 0.0, 0.0, 1.5]
    assert _reward(1.5, 4, token_level=True, at=1) == [0.0, 1.5, 0.0, 0.0]
    assert _reward(1.5, 0, token_level=True) == []


def _rollout(timeout_s: float | None, progress: Progress) -> Any:
    return SimpleNamespace(config=RunnerConfig(rollout_timeout_s=timeout_s), progress=progress, index=3)


async def test_an_episode_within_the_rollout_deadline_returns_its_value() -> None:
    async def episode() -> str:
        return "done"

    assert await _within_rollout_deadline(_rollout(None, Progress(rollout_index=3)), episode()) == "done"
    assert await _within_rollout_deadline(_rollout(5.0, Progress(rollout_index=3)), episode()) == "done"


async def test_an_episode_past_the_rollout_deadline_raises_a_timeout_naming_where_it_was() -> None:
    progress = Progress(rollout_index=3, phase="generate", turn=2)

    async def episode() -> None:
        await asyncio.sleep(10)

    with pytest.raises(RolloutTimeoutError) as caught:
        await _within_rollout_deadline(_rollout(0.05, progress), episode())
    error = caught.value
    assert (error.rollout_index, error.phase, error.turn, error.timeout_s) == (3, "generate", 2, 0.05)
    assert error.elapsed_s > 0


async def test_a_timeout_the_episode_raised_itself_is_not_the_rollout_deadline() -> None:
    async def episode() -> None:
        raise TimeoutError("the tool timed out")

    with pytest.raises(TimeoutError, match="the tool timed out") as caught:
        await _within_rollout_deadline(_rollout(5.0, Progress(rollout_index=3)), episode())
    assert not isinstance(caught.value, RolloutTimeoutError)
