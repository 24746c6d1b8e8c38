"""The runner's env threads: blocking steps of every rollout in flight run at once, a batch's history of
blocking calls carries to the next, and a close behind a stuck step takes no thread the batch needs."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from doubles import SETTLE_S, CountingTextEnv, EnvCounts, factory, fail_on, tasks
from leaks import eventually

from gym_resilience import BatchRunner, RunnerConfig
from gym_resilience.engines.scripted import ScriptedEngine


class _RendezvousEnv(CountingTextEnv):
    """Its build blocks (a sandbox starting: ``delay``), and each step waits at ``BARRIER`` for every
    other rollout's step: a batch passes only if all its steps run at once."""

    barrier: threading.Barrier

    def step(self, action: str) -> tuple[list[dict[str, str]], float, bool, bool, dict[str, Any]]:
        self.barrier.wait()
        return super().step(action)


@pytest.mark.parametrize(("env_threads", "rollouts"), [(None, 32), (4, 4)])
async def test_blocking_env_steps_of_every_rollout_in_flight_run_at_once(
    env_threads: int | None, rollouts: int
) -> None:
    """By default (``env_threads=None``) a runner whose env calls block takes a thread for each rollout in
    flight, past its first 16 (32 steps meet at a barrier); a set ``env_threads`` is taken as calls come,
    blocking or not."""
    ledger = EnvCounts()

    class Env(_RendezvousEnv):
        barrier = threading.Barrier(rollouts, timeout=30.0)

    config = RunnerConfig(max_turns=2, env_threads=env_threads)
    make = factory(ledger, turns=2, env=Env, delay=lambda task: time.sleep(0.01))
    result = await BatchRunner(ScriptedEngine(), make, config).generate(tasks(rollouts))
    assert [t.is_placeholder for t in result.trajectories] == [False] * rollouts
    assert ledger.open == 0


async def test_steps_seen_to_block_in_one_batch_run_at_once_from_the_next_batchs_first_turn() -> None:
    """The first batch's steps block (a tool call's wait); in the second, every rollout's first step meets
    the others at a barrier, though the batch's builds (fast) come first: a thread each from the start."""
    ledger = EnvCounts()
    barrier = threading.Barrier(32, timeout=SETTLE_S)

    class Env(CountingTextEnv):
        meet = False

        def step(self, action: str) -> tuple[list[dict[str, str]], float, bool, bool, dict[str, Any]]:
            if self.meet and self.turn == 0:
                barrier.wait()
            else:
                time.sleep(0.005)
            return super().step(action)

    runner = BatchRunner(ScriptedEngine(), factory(ledger, turns=2, env=Env), RunnerConfig(max_turns=2))
    await runner.generate(tasks(32))
    Env.meet = True
    result = await runner.generate(tasks(32))
    assert not any(t.is_placeholder for t in result.trajectories)
    assert ledger.open == 0


async def test_a_close_behind_a_stuck_step_leaves_the_other_pool_thread_to_the_batch() -> None:
    """The close of a rollout that gave up on a stuck step waits on that step's thread, not on a second
    one: with two threads, the rest of the batch still runs, and the env is closed when the step returns."""
    ledger = EnvCounts()
    stuck = fail_on({"t0"}, turn=0, exc=None, sleep_s=4.0)
    config = RunnerConfig(
        skip_failed_rollouts=True,
        env_threads=2,
        max_concurrency=1,
        rollout_timeout_s=1.0,
        close_timeout_s=0.5,
        max_turns=3,
    )
    result = await BatchRunner(ScriptedEngine(), factory(ledger, stuck), config).generate(tasks(4))
    assert [t.is_placeholder for t in result.trajectories] == [True, False, False, False]
    assert await eventually(lambda: ledger.open == 0)
