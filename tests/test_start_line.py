"""The start line: the rollouts a batch starts at once send their first prompts together, and a slow,
stuck or failing env holds the others back no longer than the line's wait."""

from __future__ import annotations

import asyncio
import threading

import pytest
from doubles import SETTLE_S, EnvCounts, factory, fail_on, tasks

from gym_resilience import BatchRunner, RetryPolicy, RunnerConfig, Task
from gym_resilience.engines.scripted import ScriptedEngine, echo_script
from gym_resilience.rollout import StartLine, start_line

N = 6
SLOW = f"t{N - 1}"
NO_DELAY = RetryPolicy(attempts=2, initial_delay_s=0.0, max_delay_s=0.0, jitter_s=0.0)


@pytest.fixture
def line_wait(monkeypatch: pytest.MonkeyPatch):
    """Set the start line's wait for the test."""

    def set_wait(seconds: float) -> None:
        monkeypatch.setattr(start_line, "START_WAIT_S", seconds)

    return set_wait


def recording_engine(counts: EnvCounts, seen: list[int], on_call=None) -> ScriptedEngine:
    """An engine that notes, at each call, how many envs had been built by then."""

    def script(prompt_ids, sampling, call_index):
        seen.append(counts.created)
        if on_call is not None:
            on_call(call_index)
        return echo_script(prompt_ids, sampling, call_index)

    return ScriptedEngine(script=script)


def held_until(gate: threading.Event, instance_id: str = SLOW):
    """A factory delay that holds the build of ``instance_id``'s env until ``gate`` is set."""

    def delay(task: Task) -> None:
        if task.instance_id == instance_id:
            assert gate.wait(SETTLE_S), "the test never opened the gate"

    return delay


async def test_the_first_prompts_wait_for_every_env_of_the_batch_to_open(line_wait) -> None:
    line_wait(SETTLE_S)
    counts, seen, gate = EnvCounts(), [], threading.Event()
    runner = BatchRunner(
        recording_engine(counts, seen),
        factory(counts, delay=held_until(gate)),
        RunnerConfig(max_turns=1),
    )
    batch = asyncio.ensure_future(runner.generate(tasks(N)))
    # Every env but the slow one is open, and no rollout has sent its prompt.
    await asyncio.to_thread(counts.wait_for, lambda c: c.created == N - 1)
    await asyncio.sleep(0.05)
    assert seen == []
    gate.set()
    result = await asyncio.wait_for(batch, SETTLE_S)
    assert seen == [N] * N
    assert not result.failures and counts.open == 0


async def test_a_stuck_env_holds_the_others_back_no_longer_than_the_wait(line_wait) -> None:
    line_wait(0.05)
    counts, seen, gate = EnvCounts(), [], threading.Event()

    def release_the_slow_env(call_index: int) -> None:
        if call_index == N - 2:  # every other rollout has sent its prompt without it
            gate.set()

    runner = BatchRunner(
        recording_engine(counts, seen, release_the_slow_env),
        factory(counts, delay=held_until(gate)),
        RunnerConfig(max_turns=1),
    )
    result = await asyncio.wait_for(runner.generate(tasks(N)), SETTLE_S)
    assert seen[: N - 1] == [N - 1] * (N - 1)
    assert not result.failures and counts.open == 0


async def test_a_rollout_that_fails_before_the_line_releases_the_others_at_once(line_wait) -> None:
    line_wait(10 * SETTLE_S)  # only the failure can release the line within the test's bound
    counts = EnvCounts()
    runner = BatchRunner(
        ScriptedEngine(),
        factory(counts, fail_on({SLOW}, phase="reset", turn=0)),
        RunnerConfig(max_turns=1, skip_failed_rollouts=True),
    )
    result = await asyncio.wait_for(runner.generate(tasks(N)), SETTLE_S)
    assert [f.trajectory_id.instance_id for f in result.failures] == [SLOW]
    assert counts.open == 0


async def test_retries_and_rollouts_started_later_do_not_wait_at_the_line(line_wait) -> None:
    line_wait(10 * SETTLE_S)
    counts = EnvCounts()
    retried = fail_on({"t0"}, phase="reset", turn=0, exc=ConnectionError, attempt=0)
    runner = BatchRunner(
        ScriptedEngine(),
        factory(counts, retried),
        RunnerConfig(max_turns=1, max_concurrency=2, skip_failed_rollouts=True, retry=NO_DELAY),
    )
    result = await asyncio.wait_for(runner.generate(tasks(N)), SETTLE_S)
    assert not result.failures and len(result.trajectories) == N
    assert result.metrics["retries"] == 1 and counts.open == 0


async def test_the_line_opens_when_everyone_is_there_or_at_its_deadline() -> None:
    line = StartLine(range(3), wait_s=10 * SETTLE_S)
    line.leave(7)  # not one of the line's: changes nothing
    waiting = [asyncio.ensure_future(line.ready(i)) for i in (0, 1)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiting)
    line.leave(1)  # again: nothing
    line.leave(2)
    await asyncio.wait_for(asyncio.gather(*waiting), SETTLE_S)

    late = StartLine(range(3), wait_s=0.01)
    await asyncio.wait_for(late.ready(0), SETTLE_S)  # nobody else came: the deadline let it go
    await asyncio.wait_for(late.ready(1), SETTLE_S)  # open from then on


async def test_a_lone_rollout_never_waits() -> None:
    await asyncio.wait_for(StartLine([4], wait_s=10 * SETTLE_S).ready(4), SETTLE_S)
    await asyncio.wait_for(StartLine([], wait_s=10 * SETTLE_S).ready(0), SETTLE_S)
