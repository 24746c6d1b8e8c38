"""The start line: the rollouts a batch starts at once send their first prompts together, and a slow,
stuck or failing env holds the others back no longer than the line's wait."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest
from doubles import SETTLE_S, CountingTextEnv, EnvCounts, factory, fail_on, tasks

from gym_resilience import BatchRunner, RetryPolicy, RunnerConfig, Task, UnsupportedConfigError
from gym_resilience.engines.scripted import CharTokenizer, ScriptedEngine, echo_script
from gym_resilience.rollout import ChatCodec, StartLine

N = 6
SLOW = f"t{N - 1}"
FOREVER_S = 10 * SETTLE_S
"""A line's wait that only an arrival or a failure can cut short within a test's bound."""
NO_DELAY = RetryPolicy(attempts=2, initial_delay_s=0.0, max_delay_s=0.0, jitter_s=0.0)


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


def open_gate_at_call(gate: threading.Event, call: int):
    def on_call(call_index: int) -> None:
        if call_index == call:
            gate.set()

    return on_call


async def test_the_first_prompts_wait_for_every_env_of_the_batch_to_open() -> None:
    counts, seen, gate = EnvCounts(), [], threading.Event()
    runner = BatchRunner(
        recording_engine(counts, seen),
        factory(counts, delay=held_until(gate)),
        RunnerConfig(max_turns=1, start_wait_s=FOREVER_S),
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


async def test_a_stuck_env_holds_the_others_back_no_longer_than_the_wait() -> None:
    # The slow env opens only once every other rollout has sent its prompt: a line without its
    # deadline would never let them.
    counts, seen, gate = EnvCounts(), [], threading.Event()
    runner = BatchRunner(
        recording_engine(counts, seen, open_gate_at_call(gate, N - 2)),
        factory(counts, delay=held_until(gate)),
        RunnerConfig(max_turns=1, start_wait_s=0.05),
    )
    result = await asyncio.wait_for(runner.generate(tasks(N)), SETTLE_S)
    assert not result.failures and counts.open == 0


async def test_no_wait_sends_each_prompt_as_soon_as_its_env_is_open() -> None:
    counts, seen, gate = EnvCounts(), [], threading.Event()
    runner = BatchRunner(
        recording_engine(counts, seen, open_gate_at_call(gate, 0)),
        factory(counts, delay=held_until(gate)),
        RunnerConfig(max_turns=1, start_wait_s=0),
    )
    result = await asyncio.wait_for(runner.generate(tasks(N)), SETTLE_S)
    assert not result.failures and counts.open == 0


async def test_a_rollout_that_fails_before_the_line_releases_the_others_at_once() -> None:
    counts = EnvCounts()
    runner = BatchRunner(
        ScriptedEngine(),
        factory(counts, fail_on({SLOW}, phase="reset", turn=0)),
        RunnerConfig(max_turns=1, skip_failed_rollouts=True, start_wait_s=FOREVER_S),
    )
    result = await asyncio.wait_for(runner.generate(tasks(N)), SETTLE_S)
    assert [f.trajectory_id.instance_id for f in result.failures] == [SLOW]
    assert counts.open == 0


async def test_a_retry_goes_straight_on_while_a_sibling_is_still_opening() -> None:
    # t0's first attempt fails in reset; its retry must reach the engine while t1 is still held, on a
    # line that would otherwise wait for t1 far longer than the test's bound.
    counts, seen, gate = EnvCounts(), [], threading.Event()
    transient_reset_failure = fail_on({"t0"}, phase="reset", turn=0, attempt=0, exc=ConnectionError)
    runner = BatchRunner(
        recording_engine(counts, seen, open_gate_at_call(gate, 0)),
        factory(counts, transient_reset_failure, delay=held_until(gate, "t1")),
        RunnerConfig(max_turns=1, skip_failed_rollouts=True, retry=NO_DELAY, start_wait_s=FOREVER_S),
    )
    result = await asyncio.wait_for(runner.generate(tasks(2)), SETTLE_S)
    assert not result.failures and result.metrics["retries"] == 1
    assert counts.open == 0


async def test_a_rollout_started_later_goes_straight_on_while_a_sibling_is_still_opening() -> None:
    # Under max_concurrency=2, t0 fails and t2 takes its slot: t2 must reach the engine while t1 is
    # still held.
    counts, seen, gate = EnvCounts(), [], threading.Event()
    runner = BatchRunner(
        recording_engine(counts, seen, open_gate_at_call(gate, 0)),
        factory(counts, fail_on({"t0"}, phase="build", turn=0), delay=held_until(gate, "t1")),
        RunnerConfig(max_turns=1, max_concurrency=2, skip_failed_rollouts=True, start_wait_s=FOREVER_S),
    )
    result = await asyncio.wait_for(runner.generate(tasks(3)), SETTLE_S)
    assert [f.trajectory_id.instance_id for f in result.failures] == ["t0"]
    assert counts.open == 0


def hello(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"hello {i}"}]


def hellos(n: int) -> dict[int, list[dict[str, str]]]:
    """A line of ``n`` rollouts, each task's prompt ``hello(index)``."""
    return {i: hello(i) for i in range(n)}


class CountingTokenizer(CharTokenizer):
    """Counts its template calls, and how many chats each took."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def apply_chat_template(self, conversation, **kwargs):
        batch = bool(conversation) and isinstance(conversation[0], list)
        self.calls.append(len(conversation) if batch else 1)
        if batch:
            return [
                super(CountingTokenizer, self).apply_chat_template(chat, **kwargs) for chat in conversation
            ]
        return super().apply_chat_template(conversation, **kwargs)


async def test_the_line_opens_when_everyone_is_there_or_at_its_deadline() -> None:
    codec = ChatCodec(CharTokenizer())
    line = StartLine(hellos(3), wait_s=FOREVER_S, codec=codec)
    line.leave(7)  # not one of the line's: changes nothing
    waiting = [asyncio.ensure_future(line.first_prompt(i, hello(i))) for i in (0, 1)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiting)
    line.leave(1)  # again: nothing
    line.leave(2)
    prompts = await asyncio.wait_for(asyncio.gather(*waiting), SETTLE_S)
    assert prompts == [codec.prompt(hello(0)), codec.prompt(hello(1))]

    late = StartLine(hellos(3), wait_s=0.01, codec=codec)
    # Nobody else came: the deadline let it go, and open from then on.
    assert await asyncio.wait_for(late.first_prompt(0, hello(0)), SETTLE_S) == codec.prompt(hello(0))
    assert await asyncio.wait_for(late.first_prompt(1, hello(1)), SETTLE_S) == codec.prompt(hello(1))


async def test_the_line_encodes_its_prompts_in_one_call_as_it_opens() -> None:
    tokenizer = CountingTokenizer()
    codec = ChatCodec(tokenizer)
    tokenizer.calls.clear()  # the codec's own probes
    line = StartLine(hellos(4), wait_s=FOREVER_S, codec=codec)
    waiting = [asyncio.ensure_future(line.first_prompt(i, hello(i % 3))) for i in range(4)]
    prompts = await asyncio.wait_for(asyncio.gather(*waiting), SETTLE_S)
    assert tokenizer.calls == [3]  # the same chat twice is encoded once
    assert prompts == [codec.prompt(hello(i % 3)) for i in range(4)]
    assert prompts[0] is not prompts[3]  # each rollout owns its list


@pytest.mark.parametrize("ahead", [False, True], ids=["at-the-line", "encoded-ahead"])
async def test_a_rollout_cancelled_at_the_line_leaves_the_others_their_prompts(ahead: bool) -> None:
    codec = ChatCodec(CharTokenizer())
    line = StartLine(hellos(3), wait_s=FOREVER_S, codec=codec)
    if ahead:
        line.encode_ahead()
        await asyncio.sleep(0)
    cancelled = asyncio.ensure_future(line.first_prompt(0, hello(0)))
    waiting = asyncio.ensure_future(line.first_prompt(1, hello(1)))
    await asyncio.sleep(0)
    cancelled.cancel()
    await asyncio.sleep(0)
    assert await asyncio.wait_for(line.first_prompt(2, hello(2)), SETTLE_S) == codec.prompt(hello(2))
    assert await asyncio.wait_for(waiting, SETTLE_S) == codec.prompt(hello(1))
    assert cancelled.cancelled()


class Stopping(CharTokenizer):
    """Rejects a chat whose last message says "stop", raising StopIteration (which a future refuses as an
    exception: the codec wraps it)."""

    def apply_chat_template(self, conversation, **kwargs):
        if conversation and isinstance(conversation[-1], dict) and conversation[-1]["content"] == "stop":
            raise StopIteration
        return super().apply_chat_template(conversation, **kwargs)


@pytest.mark.parametrize("ahead", [False, True], ids=["at-the-line", "encoded-ahead"])
async def test_a_template_raising_stop_iteration_fails_only_its_rollout_at_the_line(ahead: bool) -> None:
    codec = ChatCodec(Stopping())
    stop = [{"role": "user", "content": "stop"}]
    line = StartLine({0: hello(0), 1: stop, 2: hello(2)}, wait_s=FOREVER_S, codec=codec)
    if ahead:
        line.encode_ahead()
        await asyncio.sleep(0)
    first = asyncio.ensure_future(line.first_prompt(0, hello(0)))
    stopped = asyncio.ensure_future(line.first_prompt(1, stop))
    assert await asyncio.wait_for(line.first_prompt(2, hello(2)), SETTLE_S) == codec.prompt(hello(2))
    assert await asyncio.wait_for(first, SETTLE_S) == codec.prompt(hello(0))
    with pytest.raises(RuntimeError, match="StopIteration"):
        await asyncio.wait_for(stopped, SETTLE_S)


async def test_a_rollout_whose_opening_is_no_chat_leaves_the_line_before_its_env_closes() -> None:
    counts, seen, gate = EnvCounts(), [], threading.Event()

    class NoChatOpening(CountingTextEnv):
        """t1's reset returns no chat; its close waits for the first engine call."""

        def reset(self, *, seed=None, options=None):
            observation, info = super().reset(seed=seed, options=options)
            return (42 if self.task.instance_id == "t1" else observation), info

        def close(self) -> None:
            if self.task.instance_id == "t1":
                assert gate.wait(SETTLE_S), "the line waited for this env's close"
            super().close()

    runner = BatchRunner(
        recording_engine(counts, seen, open_gate_at_call(gate, 0)),
        factory(counts, env=NoChatOpening),
        RunnerConfig(max_turns=1, skip_failed_rollouts=True, start_wait_s=FOREVER_S),
    )
    result = await asyncio.wait_for(runner.generate(tasks(4)), SETTLE_S)
    assert [(f.trajectory_id.instance_id, f.phase) for f in result.failures] == [("t1", "reset")]
    assert counts.open == 0


async def test_a_lone_rollout_and_a_line_without_a_wait_never_wait() -> None:
    codec = ChatCodec(CharTokenizer())
    for line, index in (
        (StartLine({4: hello(4)}, wait_s=FOREVER_S, codec=codec), 4),
        (StartLine({}, wait_s=FOREVER_S, codec=codec), 0),
        (StartLine(hellos(3), wait_s=0, codec=codec), 0),
    ):
        assert await asyncio.wait_for(line.first_prompt(index, hello(0)), SETTLE_S) == codec.prompt(hello(0))


@pytest.mark.parametrize("value", [-0.01, float("inf"), None, True])
def test_a_start_wait_that_is_not_a_finite_non_negative_number_is_rejected_naming_it(value) -> None:
    with pytest.raises(UnsupportedConfigError, match="start_wait_s"):
        RunnerConfig(start_wait_s=value)


# --- Task prompts encoded ahead, while the envs open. ----------------------------------------------------


async def test_openings_that_are_their_task_prompts_take_the_ids_encoded_ahead() -> None:
    tokenizer = CountingTokenizer()
    codec = ChatCodec(tokenizer)
    tokenizer.calls.clear()
    line = StartLine(hellos(3), wait_s=FOREVER_S, codec=codec)
    line.encode_ahead()
    await asyncio.sleep(0)  # the loop's next pass encodes them, in one call
    assert tokenizer.calls == [3]
    waiting = [asyncio.ensure_future(line.first_prompt(i, hello(i))) for i in range(3)]
    prompts = await asyncio.wait_for(asyncio.gather(*waiting), SETTLE_S)
    assert tokenizer.calls == [3]  # nothing left to encode as the line opened
    assert prompts == [codec.prompt(hello(i)) for i in range(3)]
    assert (line.arrived, line.matched) == (3, 3) and line.worth_encoding_ahead(default=False)


async def test_an_opening_other_than_its_task_prompt_is_encoded_as_the_line_opens() -> None:
    tokenizer = CountingTokenizer()
    codec = ChatCodec(tokenizer)
    tokenizer.calls.clear()
    # Rollout 2's opening equals its task's prompt (1 == True) but renders otherwise.
    task_prompts = {0: hello(0), 1: hello(1), 2: [{"role": "user", "content": 1}]}
    openings = [
        hello(0),
        [{"role": "system", "content": "be brief"}, *hello(1)],
        [{"role": "user", "content": True}],
    ]
    line = StartLine(task_prompts, wait_s=FOREVER_S, codec=codec)
    line.encode_ahead()
    await asyncio.sleep(0)
    waiting = [asyncio.ensure_future(line.first_prompt(i, opening)) for i, opening in enumerate(openings)]
    prompts = await asyncio.wait_for(asyncio.gather(*waiting), SETTLE_S)
    assert tokenizer.calls == [3, 2]  # ahead, then the two openings that were not their task's prompt
    assert prompts == [codec.prompt(opening) for opening in openings]
    assert prompts[2] != codec.prompt(task_prompts[2])
    assert (line.arrived, line.matched) == (3, 1) and not line.worth_encoding_ahead(default=True)


async def test_a_task_prompt_that_is_no_chat_is_not_encoded_ahead_and_its_opening_is_at_the_line() -> None:
    tokenizer = CountingTokenizer()
    codec = ChatCodec(tokenizer)
    tokenizer.calls.clear()
    line = StartLine({0: "hello 0", 1: None, 2: hello(2)}, wait_s=FOREVER_S, codec=codec)
    line.encode_ahead()
    await asyncio.sleep(0)
    assert tokenizer.calls == [1]  # only the chat
    waiting = [asyncio.ensure_future(line.first_prompt(i, hello(i))) for i in range(3)]
    prompts = await asyncio.wait_for(asyncio.gather(*waiting), SETTLE_S)
    assert tokenizer.calls == [1, 2]
    assert prompts == [codec.prompt(hello(i)) for i in range(3)]
    assert (line.arrived, line.matched) == (3, 1)


@pytest.mark.parametrize("ahead", [False, True], ids=["at-the-line", "encoded-ahead"])
async def test_an_opening_equal_to_its_task_prompt_but_rendered_apart_is_no_match_either_way(
    ahead: bool,
) -> None:
    """The line counts a match alike whether it encoded ahead or not, so that the runner's choice for the
    next batch does not flip on openings that compare equal and render apart."""
    codec = ChatCodec(CharTokenizer())
    task_prompts = {0: hello(0), 1: [{"role": "user", "content": 1}], 2: hello(2)}
    openings = [hello(0), [{"role": "user", "content": True}], [{"content": "hello 2", "role": "user"}]]
    line = StartLine(task_prompts, wait_s=FOREVER_S, codec=codec)
    if ahead:
        line.encode_ahead()
        await asyncio.sleep(0)
    waiting = [asyncio.ensure_future(line.first_prompt(i, opening)) for i, opening in enumerate(openings)]
    prompts = await asyncio.wait_for(asyncio.gather(*waiting), SETTLE_S)
    assert prompts == [codec.prompt(opening) for opening in openings]
    assert (line.arrived, line.matched) == (3, 1)


async def test_a_task_prompt_the_template_rejects_ahead_leaves_no_error_unread() -> None:
    """Its rollout opened with another chat: the failed encoding ahead is dropped, not left for asyncio
    to report as an exception never retrieved."""
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        codec = ChatCodec(Stopping())
        stop = [{"role": "user", "content": "stop"}]
        line = StartLine({0: hello(0), 1: stop}, wait_s=FOREVER_S, codec=codec)
        line.encode_ahead()
        await asyncio.sleep(0)
        openings = [hello(0), hello(1)]
        waiting = [asyncio.ensure_future(line.first_prompt(i, opening)) for i, opening in enumerate(openings)]
        assert await asyncio.wait_for(asyncio.gather(*waiting), SETTLE_S) == [
            codec.prompt(o) for o in openings
        ]
        del line, waiting
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(handler)
    assert reported == []


class InterruptedOnce(CharTokenizer):
    """Raises KeyboardInterrupt in its ``armed``-th call with a batch of chats (as a Ctrl-C landing in
    the template would)."""

    def __init__(self, armed: int) -> None:
        self.armed = armed

    def apply_chat_template(self, conversation, **kwargs):
        if conversation and isinstance(conversation[0], list):
            self.armed -= 1
            if self.armed == 0:
                raise KeyboardInterrupt
            return [super(InterruptedOnce, self).apply_chat_template(chat, **kwargs) for chat in conversation]
        return super().apply_chat_template(conversation, **kwargs)


async def test_an_interrupt_in_the_encoding_ahead_is_raised_in_the_rollouts_of_the_line() -> None:
    codec = ChatCodec(InterruptedOnce(armed=2))  # the first call is the codec's own probe
    line = StartLine(hellos(2), wait_s=FOREVER_S, codec=codec)
    line.encode_ahead()
    await asyncio.sleep(0)
    for index in range(2):
        with pytest.raises(KeyboardInterrupt):  # raised as it arrives, in the rollout's own task
            await line.first_prompt(index, hello(index))


async def test_an_interrupt_in_the_encoding_ahead_reaches_the_runners_caller_with_every_env_closed() -> None:
    counts = EnvCounts()
    # Calls with a batch: the codec's probe, the first batch's ahead encoding, the second's.
    engine = ScriptedEngine(tokenizer=InterruptedOnce(armed=3))
    runner = BatchRunner(engine, factory(counts), RunnerConfig(max_turns=1, start_wait_s=FOREVER_S))
    await asyncio.wait_for(runner.generate(tasks(N)), SETTLE_S)
    with pytest.raises(KeyboardInterrupt):  # awaited in this task: a task would pass it to the loop
        await runner.generate(tasks(N))
    assert counts.open == 0


class RecordingTokenizer(CharTokenizer):
    """Records the role of the first message of each chat it encodes in a batch, call by call."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def apply_chat_template(self, conversation, **kwargs):
        if conversation and isinstance(conversation[0], list):
            self.batches.append([chat[0]["role"] for chat in conversation])
            return [
                super(RecordingTokenizer, self).apply_chat_template(chat, **kwargs) for chat in conversation
            ]
        return super().apply_chat_template(conversation, **kwargs)


class SystemFirstEnv(CountingTextEnv):
    """Opens the tasks named ``s...`` with a system message before their prompt."""

    def reset(self, *, seed=None, options=None):
        observation, info = super().reset(seed=seed, options=options)
        if self.task.instance_id.startswith("s"):
            observation = [{"role": "system", "content": "be brief"}, *observation]
        return observation, info


async def test_the_runner_encodes_ahead_only_while_most_envs_open_with_their_task_prompt() -> None:
    tokenizer = RecordingTokenizer()
    counts = EnvCounts()
    engine = ScriptedEngine(tokenizer=tokenizer)
    runner = BatchRunner(
        engine, factory(counts, env=SystemFirstEnv), RunnerConfig(max_turns=1, start_wait_s=FOREVER_S)
    )
    codec = ChatCodec(tokenizer)

    async def batch_of(prefix: str) -> list[list[str]]:
        tokenizer.batches.clear()
        batch = tasks(N, prefix)
        result = await asyncio.wait_for(runner.generate(batch), SETTLE_S)
        opened = [
            ([{"role": "system", "content": "be brief"}] if prefix == "s" else []) + task.prompt
            for task in batch
        ]
        assert result.output.prompt_token_ids == [codec.prompt(chat) for chat in opened]
        return tokenizer.batches

    await batch_of("t")  # the codec's first batch: encodes ahead, every opening matches
    assert await batch_of("t") == [["user"] * N]  # ahead; nothing at the line
    assert await batch_of("s") == [["user"] * N, ["system"] * N]  # ahead, wasted; then at the line
    assert await batch_of("s") == [["system"] * N]  # no longer ahead
    assert await batch_of("t") == [["user"] * N]  # at the line: the openings matched again...
    assert await batch_of("t") == [["user"] * N]  # ...so ahead once more
    assert counts.open == 0


class ReorderedEnv(CountingTextEnv):
    """Opens with its task's prompt, each message's keys in the other order: equal, rendered apart."""

    def reset(self, *, seed=None, options=None):
        observation, info = super().reset(seed=seed, options=options)
        return [{"content": m["content"], "role": m["role"]} for m in observation], info


async def test_the_runner_stays_off_encoding_ahead_for_openings_equal_but_rendered_apart() -> None:
    tokenizer = RecordingTokenizer()
    counts = EnvCounts()
    runner = BatchRunner(
        ScriptedEngine(tokenizer=tokenizer),
        factory(counts, env=ReorderedEnv),
        RunnerConfig(max_turns=1, start_wait_s=FOREVER_S),
    )
    calls = []
    for _ in range(4):
        tokenizer.batches.clear()
        await asyncio.wait_for(runner.generate(tasks(N)), SETTLE_S)
        calls.append(len(tokenizer.batches))
    # The first: the codec's probe, the encoding ahead (wasted) and the line's; then the line's alone.
    assert calls == [3, 1, 1, 1]
    assert counts.open == 0
