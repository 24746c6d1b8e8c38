"""The turn line: rollouts that step their envs while the engine has none of the batch's requests send
their next prompts together, and nothing waits on it for long."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from doubles import SETTLE_S, CountingTextEnv, EnvCounts, factory, tasks

from gym_resilience import BatchRunner, RunnerConfig, UnsupportedConfigError
from gym_resilience.engines import Sampling
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.rollout import TurnLine
from gym_resilience.trajectories import without_timings

FOREVER_S = 3600.0


async def _ready(line: TurnLine, name: str, sent: list[str]) -> None:
    await line.next_turn()
    sent.append(name)


def _between(count: int, wait_s: float = FOREVER_S) -> tuple[TurnLine, list[str]]:
    """A turn line with ``count`` rollouts between turns, its engine seen with two requests at once, and
    the list its rollouts note their sends in."""
    line = TurnLine(wait_s)
    with line.request(), line.request():
        pass
    for _ in range(count):
        line.generated()
    return line, []


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_rollouts_between_turns_wait_for_the_last_of_them_and_go_together() -> None:
    line, sent = _between(3)
    first = asyncio.create_task(_ready(line, "a", sent))
    second = asyncio.create_task(_ready(line, "b", sent))
    await _settle()
    assert sent == []  # the third is still stepping its env
    await _ready(line, "c", sent)  # the last: it opens the line and goes at once
    await asyncio.gather(first, second)
    assert sorted(sent) == ["a", "b", "c"]


async def test_a_request_in_flight_lets_every_rollout_go_at_once() -> None:
    line, sent = _between(3)
    held = asyncio.create_task(_ready(line, "held", sent))
    await _settle()
    assert sent == []
    with line.request():  # a rollout started late (its first turn) sends a request: the engine is busy
        await held
        await _ready(line, "busy", sent)  # with a request in flight, nobody waits
    assert sent == ["held", "busy"]


async def test_the_last_rollout_between_turns_ending_lets_the_waiting_ones_go() -> None:
    line, sent = _between(2)
    held = asyncio.create_task(_ready(line, "held", sent))
    await _settle()
    assert sent == []
    line.left()  # its episode ended at that step
    await held
    assert sent == ["held"]


async def test_a_rollout_waits_no_longer_than_turn_wait_s_for_one_that_never_comes() -> None:
    line, sent = _between(2, 0.05)  # the other is stuck in its env step for good
    await asyncio.wait_for(_ready(line, "held", sent), SETTLE_S)
    assert sent == ["held"]


async def test_no_rollout_waits_with_turn_wait_s_zero() -> None:
    line, sent = _between(2, 0.0)
    await _ready(line, "first", sent)  # would wait for the second with a wait
    assert sent == ["first"]


async def test_a_rollout_cancelled_while_it_waits_leaves_the_others_waiting_and_then_going() -> None:
    line, sent = _between(3)
    cancelled = asyncio.create_task(_ready(line, "cancelled", sent))
    held = asyncio.create_task(_ready(line, "held", sent))
    await _settle()
    cancelled.cancel()
    await asyncio.gather(cancelled, return_exceptions=True)
    await _settle()
    assert sent == []
    await _ready(line, "last", sent)
    await held
    assert sorted(sent) == ["held", "last"]


def test_turn_wait_s_must_be_a_non_negative_number() -> None:
    with pytest.raises(UnsupportedConfigError, match="turn_wait_s"):
        RunnerConfig(turn_wait_s=-1.0)
    assert RunnerConfig(turn_wait_s=0).turn_wait_s == 0


class _StaggeredEnv(CountingTextEnv):
    """Each env's step takes a different time (rollout i: 4 ms x i), and notes when each ended."""

    ended: dict[tuple[str, int], float]

    def step(self, action: str) -> tuple[list[dict[str, str]], float, bool, bool, dict[str, Any]]:
        index = int(self.task.instance_id[1:])
        time.sleep(0.004 * index)
        try:
            return super().step(action)
        finally:
            self.ended[(self.task.instance_id, self.turn)] = time.monotonic()


class _SendTimes:
    """An engine that notes when each rollout's requests were sent, by rollout and turn."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.sent: list[float] = []

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Any:
        self.sent.append(time.monotonic())
        return await self.engine.generate(prompt_ids, sampling)


async def _staggered_batch(
    engine: Any, wait_s: float, n: int = 8
) -> tuple[Any, _SendTimes, dict[Any, float]]:
    ended: dict[tuple[str, int], float] = {}

    class Env(_StaggeredEnv):
        pass

    Env.ended = ended
    sends = _SendTimes(engine)
    config = RunnerConfig(max_turns=3, max_tokens=8, turn_wait_s=wait_s)
    ledger = EnvCounts()
    result = await BatchRunner(sends, factory(ledger, turns=3, env=Env), config).generate(tasks(n))
    assert ledger.open == 0 and ledger.closed_more_than_once() == 0
    return result, sends, ended


def _sent_before_the_last_step_ended(sends: _SendTimes, ended: dict[Any, float], n: int) -> int:
    """Requests of the second turn sent before the slowest env of the first turn finished its step."""
    last_step = max(at for (_, turn), at in ended.items() if turn == 1)
    second_turn = sorted(sends.sent)[n : 2 * n]
    return sum(at < last_step for at in second_turn)


async def test_a_turns_requests_wait_for_the_slowest_step_of_their_turn_on_the_scripted_engine() -> None:
    """The envs' steps end over 28 ms: with the line, no second-turn request goes before the last ends;
    without it, the first go at once."""
    engine = ScriptedEngine(delay_s=0.001)  # its requests are in flight together, as a real engine's
    _, sends, ended = await _staggered_batch(engine, FOREVER_S)
    assert _sent_before_the_last_step_ended(sends, ended, 8) == 0
    _, sends, ended = await _staggered_batch(engine, 0.0)
    assert _sent_before_the_last_step_ended(sends, ended, 8) > 0


async def test_nothing_waits_for_an_engine_that_answers_before_the_loop_moves_on() -> None:
    """Never seen with two requests at once, the engine gains nothing from prompts sent together."""
    _, sends, ended = await _staggered_batch(ScriptedEngine(), FOREVER_S)
    assert _sent_before_the_last_step_ended(sends, ended, 8) > 0


async def test_a_line_whose_engine_never_held_two_requests_lets_every_rollout_go() -> None:
    line, sent = TurnLine(FOREVER_S), []
    with line.request():
        pass
    line.generated()
    line.generated()
    await _ready(line, "first", sent)
    assert sent == ["first"]


@pytest.mark.slow
async def test_on_real_vllm_a_turns_requests_go_together_and_the_tokens_are_those_sent_one_by_one(
    vllm_engine: Any,
) -> None:
    lined, sends, ended = await _staggered_batch(vllm_engine, FOREVER_S)
    assert _sent_before_the_last_step_ended(sends, ended, 8) == 0
    unlined, _, _ = await _staggered_batch(vllm_engine, 0.0)
    assert [without_timings(t) for t in lined.trajectories] == [
        without_timings(t) for t in unlined.trajectories
    ]


class _StuckOnceEnv(CountingTextEnv):
    """Rollout t0's second step blocks until ``release`` is set; every other env steps at once."""

    release: threading.Event
    others_done: threading.Event
    finished: list[str]

    def step(self, action: str) -> tuple[list[dict[str, str]], float, bool, bool, dict[str, Any]]:
        if self.task.instance_id == "t0" and self.turn == 1:
            self.release.wait(SETTLE_S)
        result = super().step(action)
        if result[2]:
            self.finished.append(self.task.instance_id)
            if len(self.finished) == 3:
                self.others_done.set()
        return result


async def test_a_stuck_env_step_holds_the_others_no_longer_than_turn_wait_s() -> None:
    release, others_done, finished = threading.Event(), threading.Event(), []

    class Env(_StuckOnceEnv):
        pass

    Env.release, Env.others_done, Env.finished = release, others_done, finished
    config = RunnerConfig(max_turns=3, turn_wait_s=0.05)
    ledger = EnvCounts()
    engine = ScriptedEngine(delay_s=0.001)  # in flight together: the line holds rollouts for each other
    batch = asyncio.create_task(
        BatchRunner(engine, factory(ledger, turns=3, env=Env), config).generate(tasks(4))
    )
    try:
        await asyncio.to_thread(others_done.wait, SETTLE_S)
        assert sorted(finished) == ["t1", "t2", "t3"]  # while t0 is still stuck in its step
    finally:
        release.set()
    result = await batch
    assert not any(t.is_placeholder for t in result.trajectories)
    assert ledger.open == 0
