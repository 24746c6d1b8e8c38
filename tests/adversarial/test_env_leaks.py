"""No env outlives its batch: a rollout that gives up while its env is being built still gets it closed.

The envs here arrive after their rollout gave up: a factory waits on an event that the test sets only once
``generate()`` has raised or returned, so the env is built by a thread nobody waits for any more. Isolated
envs are built in real worker processes, some of which never finish building. ``no_leaks`` (tests/leaks.py)
checks that envs, threads, file descriptors and child processes are back where they started.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Collection
from typing import Any

import pytest
from doubles import SETTLE_S, EnvCounts, Factory, env_fn, factory, hang_on, tasks
from leaks import alive_workers, eventually, no_leaks, wait_until, worker_processes

from gym_resilience import (
    BatchRunner,
    EnvTimeoutError,
    ResilientEnv,
    RolloutTimeoutError,
    RunnerConfig,
    Task,
    UnsupportedConfigError,
)
from gym_resilience.backends.process import IsolatedEnv
from gym_resilience.backends.protocol import StartAbort
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.errors import EnvClosedError

pytestmark = pytest.mark.slow

GIVE_UP_S = 1.0
"""close_timeout_s and rollout_timeout_s here: far shorter than the gated factories below take (SETTLE_S),
and long enough for the others to finish on a loaded machine."""


def gated_factory(counts: EnvCounts, gate: threading.Event, slow: set[str] | None = None) -> Factory:
    """Envs that are built only once ``gate`` is set (for the tasks in ``slow``; all when None)."""

    def delay(task: Task) -> None:
        if slow is None or task.instance_id in slow:
            gate.wait(SETTLE_S)

    return factory(counts, delay=delay)


def stuck(instance_ids: Collection[str], phase: str = "build") -> Factory:
    """Envs that hang in ``phase`` for the tasks of ``instance_ids``: never built, or stuck in a step."""
    return factory(EnvCounts(), hang_on(instance_ids, phase))


def late_notes(error: BaseException) -> list[str]:
    return [note for note in getattr(error, "__notes__", []) if "still being built" in note]


@pytest.fixture(scope="module", autouse=True)
def _fork_server_started() -> None:
    """The fork server is started once per program and stays: start it before any leak snapshot."""
    ResilientEnv.isolated(env_fn()).close()


async def test_cancelling_generate_while_envs_are_built_closes_each_env_when_it_arrives() -> None:
    counts, gate = EnvCounts(), threading.Event()
    config = RunnerConfig(close_timeout_s=GIVE_UP_S)
    runner = BatchRunner(ScriptedEngine(), gated_factory(counts, gate), config)
    with no_leaks(counts):
        batch = asyncio.create_task(runner.generate(tasks(3)))
        assert await eventually(lambda: counts.building == 3)
        batch.cancel()
        with pytest.raises(asyncio.CancelledError) as info:
            await batch
        assert counts.created == 0
        assert late_notes(info.value) == [
            "3 envs were still being built or closed when the batch stopped waiting for them "
            f"(close_timeout_s={GIVE_UP_S:g}): the thread of each closes it when its call returns"
        ]
        gate.set()
    assert counts.created == counts.closed == 3


async def test_a_rollout_timeout_while_envs_are_built_counts_them_and_closes_each_when_it_arrives() -> None:
    counts, gate = EnvCounts(), threading.Event()
    config = RunnerConfig(skip_failed_rollouts=True, rollout_timeout_s=GIVE_UP_S, close_timeout_s=GIVE_UP_S)
    runner = BatchRunner(ScriptedEngine(), gated_factory(counts, gate, slow={"t0", "t2"}), config)
    with no_leaks(counts):
        result = await runner.generate(tasks(4))
        assert [failure.rollout_index for failure in result.failures] == [0, 2]
        for failure in result.failures:
            assert isinstance(failure.exception, RolloutTimeoutError)
            assert len(late_notes(failure.exception)) == 1
        assert result.metrics["envs_closed_late"] == 2.0
        assert (counts.created, counts.closed) == (2, 2)
        gate.set()
    assert counts.created == counts.closed == 4


async def test_a_rollout_timeout_while_envs_are_built_without_skipping_says_so_on_the_raised_error() -> None:
    counts, gate = EnvCounts(), threading.Event()
    config = RunnerConfig(rollout_timeout_s=GIVE_UP_S, close_timeout_s=GIVE_UP_S)
    runner = BatchRunner(ScriptedEngine(), gated_factory(counts, gate, slow={"t1"}), config)
    with no_leaks(counts):
        with pytest.raises(RolloutTimeoutError) as info:
            await runner.generate(tasks(3))
        assert info.value.rollout_index == 1
        assert any("1 env was still being built or closed" in note for note in late_notes(info.value))
        gate.set()
    assert counts.created == counts.closed == 3


async def test_a_batch_that_finishes_its_creations_in_time_reports_no_late_envs() -> None:
    counts = EnvCounts()
    runner = BatchRunner(ScriptedEngine(), factory(counts), RunnerConfig(skip_failed_rollouts=True))
    with no_leaks(counts):
        result = await runner.generate(tasks(4))
    assert result.metrics["envs_closed_late"] == 0.0
    assert counts.created == counts.closed == 4


async def test_cancelling_generate_while_isolated_envs_are_built_kills_their_workers() -> None:
    config = RunnerConfig(isolate_envs=True, close_timeout_s=GIVE_UP_S)
    runner = BatchRunner(ScriptedEngine(), stuck({"t0", "t1", "t2"}), config)
    with no_leaks():
        batch = asyncio.create_task(runner.generate(tasks(3)))
        assert await eventually(lambda: len(worker_processes()) == 3)
        batch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(batch, SETTLE_S)
        assert worker_processes() == set()


async def test_an_isolated_factory_that_never_returns_is_killed_at_the_create_deadline() -> None:
    config = RunnerConfig(skip_failed_rollouts=True, isolate_envs=True, env_create_timeout_s=1.0)
    with no_leaks():
        async with BatchRunner(ScriptedEngine(), stuck({"t1"}), config) as runner:
            # A liveness guard, not a speed check: without the deadline this batch would never finish.
            result = await asyncio.wait_for(runner.generate(tasks(3)), SETTLE_S)
            assert [trajectory.is_placeholder for trajectory in result.trajectories] == [False, True, False]
            error = result.failures[0].exception
            assert isinstance(error, EnvTimeoutError)
            assert str(error) == "env start exceeded its 1 s deadline"
            # The stuck worker is gone; the two that served the other rollouts wait for the next batch.
            assert len(worker_processes()) == alive_workers(runner) == 2
        assert worker_processes() == set()


async def test_an_isolated_factory_that_never_returns_is_killed_at_the_rollout_deadline() -> None:
    config = RunnerConfig(skip_failed_rollouts=True, isolate_envs=True, rollout_timeout_s=1.0)
    with no_leaks():
        async with BatchRunner(ScriptedEngine(), stuck({"t0"}), config) as runner:
            result = await asyncio.wait_for(runner.generate(tasks(3)), SETTLE_S)
            assert isinstance(result.failures[0].exception, RolloutTimeoutError)
            assert result.metrics["envs_closed_late"] == 0.0
            assert len(worker_processes()) == alive_workers(runner) == 2
        assert worker_processes() == set()


async def test_an_isolated_step_stuck_without_a_step_deadline_is_killed_when_its_rollout_times_out() -> None:
    config = RunnerConfig(
        skip_failed_rollouts=True, isolate_envs=True, rollout_timeout_s=1.0, close_timeout_s=GIVE_UP_S
    )
    with no_leaks():
        async with BatchRunner(ScriptedEngine(), stuck({"t2"}, phase="step"), config) as runner:
            result = await asyncio.wait_for(runner.generate(tasks(3)), SETTLE_S)
            failure = result.failures[0]
            assert isinstance(failure.exception, RolloutTimeoutError) and failure.phase == "step"
            assert len(worker_processes()) == alive_workers(runner) == 2
    assert worker_processes() == set()


def test_an_env_create_deadline_needs_isolation_at_construction() -> None:
    with pytest.raises(
        UnsupportedConfigError, match=r"^env_create_timeout_s: needs env_backend='process' or 'ray'"
    ):
        RunnerConfig(env_create_timeout_s=1.0)


def test_an_infinite_close_timeout_is_rejected_at_construction() -> None:
    with pytest.raises(
        UnsupportedConfigError, match=r"^close_timeout_s: expected a finite number, got \.inf$"
    ):
        RunnerConfig(close_timeout_s=math.inf)


def test_aborting_an_isolated_start_from_another_thread_kills_the_worker_and_raises_env_closed() -> None:
    abort = StartAbort()
    never_built = env_fn(hang_on(None, "build"))
    with no_leaks():
        killer = threading.Thread(target=lambda: (wait_until(worker_processes), abort.abort()))
        killer.start()
        with pytest.raises(EnvClosedError, match=r"^cannot start: the env is closed$"):
            IsolatedEnv(never_built, abort=abort)
        killer.join(SETTLE_S)
        assert worker_processes() == set()


def test_an_isolated_start_aborted_before_it_began_leaves_no_worker() -> None:
    abort = StartAbort()
    abort.abort()
    with no_leaks(), pytest.raises(EnvClosedError):
        IsolatedEnv(env_fn(), abort=abort)


async def test_an_env_handed_over_as_its_rollout_gives_up_is_closed_however_late_the_hand_over_arrives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a busy machine the thread that built an env can be held between handing it over and the event
    loop seeing it for longer than close_timeout_s. A rollout cancelled in that window still closes it:
    the thread will not, since it handed the env over."""
    held = hold_hand_overs(monkeypatch, 0.3)
    counts = EnvCounts()
    runner = BatchRunner(ScriptedEngine(), factory(counts), RunnerConfig(close_timeout_s=0.05))
    batch = asyncio.create_task(runner.generate(tasks(4)))
    assert await eventually(lambda: len(held) == 4)  # built and reset, their hand-overs held
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    assert await eventually(lambda: counts.open == 0), f"envs left open: {counts}"
    assert counts.closed_more_than_once() == 0


async def test_a_rollout_cancelled_again_while_it_waits_for_its_env_still_closes_the_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sibling's failure cancels the rollout, and its deadline cancels it once more while it waits for
    the env its thread is handing over: the env is still closed (the second cancellation used to skip
    the close)."""
    held = hold_hand_overs(monkeypatch, 0.5)
    counts = EnvCounts()
    config = RunnerConfig(close_timeout_s=0.05, rollout_timeout_s=0.3)
    batch = asyncio.create_task(BatchRunner(ScriptedEngine(), factory(counts), config).generate(tasks(4)))
    assert await eventually(lambda: len(held) == 4)  # built and reset, their hand-overs held
    batch.cancel()  # first cancellation; each rollout's deadline fires while it waits for its env
    with pytest.raises(asyncio.CancelledError):
        await batch
    assert await eventually(lambda: counts.open == 0), f"envs left open: {counts}"
    assert counts.closed_more_than_once() == 0


def hold_hand_overs(monkeypatch: pytest.MonkeyPatch, seconds: float) -> list[object]:
    """Hold every pool thread ``seconds`` between a call's return and its hand-over to the event loop, as
    a thread descheduled right after the call would be; the outcomes held so far."""
    from gym_resilience.rollout import EnvPool

    hand_over = EnvPool._hand_over
    held: list[object] = []

    def held_hand_over(self: EnvPool, outcome: Any, *, last: bool) -> Any:
        held.append(outcome)
        time.sleep(seconds)
        return hand_over(self, outcome, last=last)

    monkeypatch.setattr(EnvPool, "_hand_over", held_hand_over)
    return held
