"""BatchRunner with isolated envs: a real subprocess env that hangs forever is killed at its deadline."""

from __future__ import annotations

import asyncio
import os

import psutil
import pytest
from worker_envs import hang_for_one_task

from gym_resilience import BatchRunner, EnvTimeoutError, RunnerConfig, Task
from gym_resilience.engines.scripted import ScriptedEngine

pytestmark = pytest.mark.slow

DEADLINE_S = 2.0


def batch(n: int, hanging: int) -> list[Task]:
    return [
        Task(
            prompt=[{"role": "user", "content": f"task {i}"}],
            instance_id=f"t{i}",
            env_kwargs={"hang": i == hanging},
        )
        for i in range(n)
    ]


def worker_processes() -> list[psutil.Process]:
    """Env workers still alive under this test process (the forkserver itself is not a worker)."""
    children = psutil.Process(os.getpid()).children(recursive=True)
    return [
        p
        for p in children
        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and p.ppid() != os.getpid()
    ]


async def test_a_hung_env_in_a_batch_of_16_is_killed_and_becomes_a_placeholder() -> None:
    config = RunnerConfig(
        skip_failed_rollouts=True, max_turns=2, isolate_envs=True, env_step_timeout_s=DEADLINE_S
    )
    runner = BatchRunner(ScriptedEngine(), hang_for_one_task, config)
    # A liveness guard, not a speed check: without the deadline this batch would never finish.
    result = await asyncio.wait_for(runner.generate(batch(16, hanging=5)), timeout=DEADLINE_S + 60)
    assert [t.is_placeholder for t in result.trajectories] == [i == 5 for i in range(16)]
    failure = result.failures[0]
    assert isinstance(failure.exception, EnvTimeoutError) and failure.phase == "step"
    assert str(failure.exception) == "env step exceeded its 2 s deadline"
    assert worker_processes() == []


def test_env_deadlines_need_isolation_at_construction() -> None:
    from gym_resilience import UnsupportedConfigError

    with pytest.raises(UnsupportedConfigError, match=r"^env_step_timeout_s: needs isolate_envs=True"):
        RunnerConfig(skip_failed_rollouts=True, env_step_timeout_s=DEADLINE_S)
