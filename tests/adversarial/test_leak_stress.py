"""Stress: ten thousand rollouts, 30% of them failing, slow env factories, batches cancelled at random.

Every env built is closed, and threads, file descriptors and child processes are back where they started
(tests/leaks.py). Some factories are slower than ``close_timeout_s`` and ``rollout_timeout_s``, so rollouts
give up on envs still being built, which their threads then close on arrival. Run with ``-s`` for the figures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import zlib
from collections.abc import Callable

import pytest
from doubles import CountingTextEnv, EnvCounts, factory, fail_on, tasks
from leaks import no_leaks

from gym_resilience import AllRolloutsFailedError, BatchRunner, RunnerConfig, Task
from gym_resilience.engines.scripted import ScriptedEngine

pytestmark = pytest.mark.slow

SEED = 20240611
FAILING = 0.3
"""Share of rollouts whose env fails: in its factory, its reset or a step."""
SLOW = 0.005
"""Share of factories slower than the deadlines below: they take ``SLOW_S``."""
SLOW_S = 1.5
CLOSE_TIMEOUT_S = 0.05
ROLLOUT_TIMEOUT_S = 1.0
"""In every other small batch: above the whole batch's usual time, below ``SLOW_S``."""


def draw(task: Task, salt: str) -> float:
    """A number in [0, 1) fixed by the task and what it is drawn for: faults repeat run after run."""
    return zlib.crc32(f"{SEED}/{salt}/{task.instance_id}".encode()) / 2**32


def delay(task: Task) -> None:
    slow = draw(task, "slow") < SLOW
    time.sleep(SLOW_S if slow else draw(task, "delay") * 0.002)
    if draw(task, "fail") < FAILING / 3:
        raise ConnectionError(f"no sandbox for {task.instance_id}")


FAILING_STEP = fail_on(None, turn=1, exc=ConnectionError, message="tool server went away")
FAILING_RESET = fail_on(None, phase="reset", turn=None, exc=TimeoutError, message="sandbox did not answer")


def stress_factory(counts: EnvCounts) -> Callable[[Task], CountingTextEnv]:
    """Factory faults for a third of the failing share, reset faults for a third, step faults for the rest."""
    plain = factory(counts, delay=delay)
    failing_resets = factory(counts, FAILING_RESET, delay=delay)
    failing_steps = factory(counts, FAILING_STEP, delay=delay)

    def build(task: Task) -> CountingTextEnv:
        fail = draw(task, "fail")
        if fail < FAILING / 3 or fail >= FAILING:
            return plain(task)
        return (failing_resets if fail < 2 * FAILING / 3 else failing_steps)(task)

    return build


async def test_ten_thousand_rollouts_with_failures_and_cancellations_leave_nothing_behind() -> None:
    rng = random.Random(SEED)
    counts = EnvCounts()
    engine = ScriptedEngine()
    config = RunnerConfig(
        skip_failed_rollouts=True, max_turns=3, max_tokens=8, close_timeout_s=CLOSE_TIMEOUT_S
    )
    impatient = dataclasses.replace(config, rollout_timeout_s=ROLLOUT_TIMEOUT_S)
    figures: dict[str, float] = {"rollouts": 0, "failed": 0, "closed_late": 0, "cancelled_batches": 0}
    start = time.monotonic()
    with no_leaks(counts) as leaks:
        result = await BatchRunner(engine, stress_factory(counts), config).generate(tasks(10_000, "big"))
        figures["rollouts"] += len(result.trajectories)
        figures["failed"] += len(result.failures)
        figures["closed_late"] += result.metrics["envs_closed_late"]
        assert len(result.failures) >= 0.25 * 10_000  # the injected faults, give or take the draw
        for round_ in range(20):
            runner = BatchRunner(engine, stress_factory(counts), impatient if round_ % 2 else config)
            batch = asyncio.create_task(runner.generate(tasks(200, f"r{round_}-")))
            if rng.random() < 0.5:
                await asyncio.sleep(rng.uniform(0, 0.1))
                batch.cancel()
            try:
                small = await batch
            except asyncio.CancelledError:
                figures["cancelled_batches"] += 1
                continue
            except AllRolloutsFailedError as error:  # a machine busy enough for every rollout to time out
                figures["rollouts"] += len(error.exceptions)
                figures["failed"] += len(error.exceptions)
                continue
            figures["rollouts"] += len(small.trajectories)
            figures["failed"] += len(small.failures)
            figures["closed_late"] += small.metrics["envs_closed_late"]
    print(
        f"\n{figures['rollouts']:.0f} rollouts returned ({figures['failed']:.0f} failed), "
        f"{figures['cancelled_batches']:.0f} of 20 small batches cancelled, "
        f"{figures['closed_late']:.0f} envs closed late in returned batches; {leaks}; "
        f"{time.monotonic() - start:.1f} s"
    )
    assert counts.created == counts.closed
    assert figures["cancelled_batches"] > 0
