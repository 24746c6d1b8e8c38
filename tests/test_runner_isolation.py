"""BatchRunner with isolated envs: a real subprocess env that hangs forever is killed at its deadline."""

from __future__ import annotations

import asyncio

import pytest
from doubles import EnvCounts, factory, hang_on, tasks
from leaks import worker_processes

from gym_resilience import (
    AllRolloutsFailedError,
    BatchRunner,
    EnvTimeoutError,
    RolloutTimeoutError,
    RunnerConfig,
)
from gym_resilience.engines.scripted import ScriptedEngine

pytestmark = pytest.mark.slow

DEADLINE_S = 2.0


async def test_a_hung_env_in_a_batch_of_16_is_killed_and_becomes_a_placeholder() -> None:
    config = RunnerConfig(
        skip_failed_rollouts=True, max_turns=2, isolate_envs=True, env_step_timeout_s=DEADLINE_S
    )
    runner = BatchRunner(ScriptedEngine(), factory(EnvCounts(), hang_on({"t5"})), config)
    # A liveness guard, not a speed check: without the deadline this batch would never finish.
    result = await asyncio.wait_for(runner.generate(tasks(16)), timeout=DEADLINE_S + 60)
    assert [t.is_placeholder for t in result.trajectories] == [i == 5 for i in range(16)]
    failure = result.failures[0]
    assert isinstance(failure.exception, EnvTimeoutError) and failure.phase == "step"
    assert str(failure.exception) == "env step exceeded its 2 s deadline"
    assert worker_processes() == set()


def test_env_deadlines_need_isolation_at_construction() -> None:
    from gym_resilience import UnsupportedConfigError

    with pytest.raises(
        UnsupportedConfigError, match=r"^env_step_timeout_s: needs env_backend='process' or 'ray'"
    ):
        RunnerConfig(skip_failed_rollouts=True, env_step_timeout_s=DEADLINE_S)


@pytest.mark.parametrize("env_threads", [2, 16])
async def test_isolated_envs_stuck_in_every_pool_thread_are_still_killed_on_time(env_threads: int) -> None:
    """The close that kills a stuck worker takes no pool thread, so it runs with every one of them stuck;
    killed at close_timeout_s, the env is not counted as closed late, and no worker outlives the batch."""
    config = RunnerConfig(
        skip_failed_rollouts=True,
        isolate_envs=True,
        env_threads=env_threads,
        rollout_timeout_s=DEADLINE_S,
        close_timeout_s=1.0,
        max_turns=1,
    )
    runner = BatchRunner(ScriptedEngine(), factory(EnvCounts(), hang_on(None)), config)
    with pytest.raises(AllRolloutsFailedError) as info:
        await asyncio.wait_for(runner.generate(tasks(env_threads)), timeout=DEADLINE_S + 60)
    assert not any("still being built or closed" in note for note in getattr(info.value, "__notes__", []))
    for error in info.value.exceptions:
        assert isinstance(error, RolloutTimeoutError)
        assert not any("isolate_envs=True kills" in note for note in getattr(error, "__notes__", []))
    assert worker_processes() == set()
