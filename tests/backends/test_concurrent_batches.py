"""Concurrent batches of one runner share its warm workers: together they hold no more workers than the
pool has, and neither waits on the other's forever, however few env threads each batch has. They share
them on one event loop at a time: a batch on another loop while one runs is refused."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from leaks import wait_until, worker_processes
from pool_envs import leaving_env, leaving_tasks

from gym_resilience import BatchRunner, RunnerConfig, Task, UnsupportedConfigError
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


def test_a_batch_on_a_second_event_loop_while_one_runs_is_refused_naming_the_loop(tmp_path: Path) -> None:
    # A semaphore serves one loop: batches on two loops at once would take workers past the pool's bound
    # (and, with one env thread each, wait for each other's workers forever).
    config = RunnerConfig(env_backend="process", max_concurrency=2, env_workers=2, env_threads=1)
    runner = BatchRunner(ScriptedEngine(), leaving_env, config)
    go_on = tmp_path / "go-on"  # the first batch's envs wait in their steps until it exists
    outcomes: dict[str, Any] = {}

    def first() -> None:
        try:
            outcomes["first"] = asyncio.run(runner.generate(leaving_tasks("wait", "wait", marker=str(go_on))))
        except BaseException as exc:  # handed to the test's thread
            outcomes["first"] = exc

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert wait_until(lambda: len(worker_processes()) == 2, timeout_s=HANG_S)  # both envs are built
        with pytest.raises(UnsupportedConfigError, match="another event loop") as refused:
            asyncio.run(asyncio.wait_for(runner.generate(leaving_tasks("")), HANG_S))
        assert refused.value.option == "event loop"
    finally:
        go_on.touch()
        thread.join(HANG_S)
    assert not isinstance(outcomes["first"], BaseException), outcomes["first"]
    assert not outcomes["first"].failures
    # Once no batch runs, another loop may run the next one, on the same warm workers.
    assert not asyncio.run(runner.generate(leaving_tasks("", ""))).failures
    assert runner.env_workers is not None and runner.env_workers.stats.started == 2
    asyncio.run(runner.close())
    assert worker_processes() == set()
