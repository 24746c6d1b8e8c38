"""Concurrent batches of one runner share its warm workers: together they hold no more workers than the
pool has, and neither waits on the other's forever, however few env threads each batch has."""

from __future__ import annotations

import asyncio

import pytest
from leaks import worker_processes

from gym_resilience import BatchRunner, RunnerConfig, Task
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.testing import ScriptableEnv

# Far past what two batches of four cheap two-turn rollouts take: only a deadlock reaches it.
HANG_S = 120.0


def make_env(task: Task) -> ScriptableEnv:
    return ScriptableEnv()


def tasks(tag: str) -> list[Task]:
    return [Task(prompt=[{"role": "user", "content": "go"}], instance_id=f"{tag}-{i}") for i in range(4)]


@pytest.mark.parametrize("env_threads", [1, None])
async def test_two_batches_at_once_share_the_pool_without_waiting_on_each_other(
    env_threads: int | None,
) -> None:
    # One env thread a batch: a batch's thread blocked waiting for a worker the other batch holds would
    # leave that batch's next env call, queued behind it, to wait forever.
    config = RunnerConfig(
        env_backend="process", max_concurrency=2, env_workers=2, env_threads=env_threads, max_turns=2
    )
    async with BatchRunner(ScriptedEngine(), make_env, config) as runner:
        for round_index in range(3):
            first, second = await asyncio.wait_for(
                asyncio.gather(
                    runner.generate(tasks(f"a{round_index}")), runner.generate(tasks(f"b{round_index}"))
                ),
                HANG_S,
            )
            assert not first.failures and not second.failures, (first.failures, second.failures)
            assert len(first.trajectories) == len(second.trajectories) == 4
        workers = runner.env_workers
        assert workers is not None
        assert workers.stats.most_alive <= 2
        assert workers.stats.started == 2  # both batches took turns on the same two warm workers
    assert worker_processes() == set()
