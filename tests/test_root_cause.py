"""Failure text names the root cause, and describing a failure never fails.

A typed error's message ends with ``: <RootType>: <root message>``; placeholders and metrics carry the root
cause's type; an exception whose ``__str__`` raises, returns a non-str or returns megabytes is rendered
safely and bounded, wherever the library renders it.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
from doubles import EnvCounts, Fault, factory, fail_on, tasks

from gym_resilience import (
    AllRolloutsFailedError,
    BatchRunner,
    EnvClosedError,
    EnvCloseError,
    EnvResetError,
    EnvStepError,
    EnvTimeoutError,
    ResilientEnv,
    RolloutError,
    RunnerConfig,
    Task,
    Trajectory,
    describe_exception,
    root_cause,
    validate_batch_output,
)
from gym_resilience.engines.base import Generation, Sampling
from gym_resilience.engines.scripted import ScriptedEngine, echo_script
from gym_resilience.errors import MAX_MESSAGE_CHARS, exception_message
from gym_resilience.testing import ScriptableEnv

WORD_GAME = "gym_resilience/WordGame-v0"


class UnprintableError(RuntimeError):
    """An exception whose ``__str__`` itself raises, as some C-extension and proxy errors do."""

    def __str__(self) -> str:
        raise ValueError("__str__ is broken")


class NonStrError(RuntimeError):
    """An exception whose ``__str__`` returns something that is not a str."""

    def __str__(self) -> Any:
        return 42


def raised_from(error: BaseException, cause: BaseException) -> BaseException:
    """``error`` as ``raise error from cause`` leaves it: ``__cause__`` set after ``__init__``."""
    try:
        raise error from cause
    except BaseException as caught:
        return caught


def raising(error: BaseException) -> Any:
    def behaviour(*_args: Any) -> Any:
        raise error

    return behaviour


# --- the message ---------------------------------------------------------------------------------------


def test_an_env_step_error_ends_with_the_type_and_message_of_the_exception_it_was_raised_from() -> None:
    error = raised_from(
        EnvStepError(turn=1, action_repr="'look around'", env_id=WORD_GAME),
        ConnectionError("sandbox connection dropped"),
    )
    assert str(error) == (
        "env step failed at turn 1 (action='look around') [gym_resilience/WordGame-v0]: "
        "ConnectionError: sandbox connection dropped"
    )


def test_the_message_follows_the_cause_chain_through_our_own_errors_to_the_innermost_foreign_cause() -> None:
    connection = raised_from(
        ConnectionError("sandbox connection dropped"), OSError("socket reset by its host")
    )
    step = raised_from(EnvStepError(turn=2, action_repr="'ls'"), connection)
    rollout = raised_from(RolloutError(rollout_index=3, phase="step", turn=2, elapsed_s=1.5), step)
    assert root_cause(rollout) is connection.__cause__
    assert (
        str(rollout) == "rollout 3 failed in step at turn 2 after 1.500 s: OSError: socket reset by its host"
    )
    assert str(step) == "env step failed at turn 2 (action='ls'): OSError: socket reset by its host"


def test_a_chain_of_only_our_errors_ends_with_the_innermost_one() -> None:
    timeout = EnvTimeoutError(operation="step", timeout_s=2, env_id=WORD_GAME)
    rollout = raised_from(RolloutError(rollout_index=0, phase="step", turn=0, elapsed_s=2.25), timeout)
    assert root_cause(rollout) is timeout
    assert str(rollout) == (
        "rollout 0 failed in step at turn 0 after 2.250 s: "
        "EnvTimeoutError: env step exceeded its 2 s deadline [gym_resilience/WordGame-v0]"
    )


def test_an_error_without_a_cause_keeps_its_own_message_and_is_its_own_root_cause() -> None:
    error = EnvClosedError(operation="step", env_id=WORD_GAME)
    assert str(error) == "cannot step: the env is closed [gym_resilience/WordGame-v0]"
    assert root_cause(error) is error
    plain = ValueError("plain")
    assert root_cause(plain) is plain


def test_a_cause_with_an_empty_message_is_named_by_its_type_alone() -> None:
    error = raised_from(EnvResetError(attempts=2), ConnectionResetError())
    assert str(error) == "env reset failed after 2 attempts: ConnectionResetError"


def test_a_message_that_already_quotes_its_root_cause_does_not_repeat_it() -> None:
    step = raised_from(EnvStepError(turn=0, action_repr="'a'"), ConnectionError("gone"))
    error = raised_from(AllRolloutsFailedError([step]), step)
    assert str(error) == (
        "all 1 rollouts failed; first: EnvStepError: env step failed at turn 0 (action='a'): "
        "ConnectionError: gone"
    )


def test_a_cause_cycle_is_rendered_without_recursing_forever() -> None:
    first = EnvStepError(turn=0, action_repr="'a'")
    second = EnvCloseError()
    first.__cause__, second.__cause__ = second, first
    assert root_cause(first) is second
    assert str(first) == "env step failed at turn 0 (action='a'): EnvCloseError: env close failed"
    foreign = ValueError("loop")
    looped = EnvResetError()
    looped.__cause__, foreign.__cause__ = foreign, looped
    assert str(looped) == "env reset failed: ValueError: loop"


# --- describing never fails ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "described"),
    [
        (UnprintableError(), "UnprintableError: <unprintable UnprintableError object>"),
        (NonStrError(), "NonStrError: <unprintable NonStrError object>"),
        (KeyError("token_ids"), "KeyError: 'token_ids'"),
        (TimeoutError(), "TimeoutError"),
    ],
)
def test_describe_exception_renders_any_exception_without_raising(error: Exception, described: str) -> None:
    assert describe_exception(error) == described


def test_a_huge_foreign_message_is_cut_to_the_bound_and_says_how_much_was_cut() -> None:
    huge = ValueError("x" * 10_000)
    assert MAX_MESSAGE_CHARS == 500
    assert exception_message(huge) == "x" * 500 + "... [9500 more characters]"
    step = raised_from(EnvStepError(turn=0, action_repr="'a'"), huge)
    assert (
        str(step)
        == "env step failed at turn 0 (action='a'): ValueError: " + "x" * 500 + "... [9500 more characters]"
    )


def test_a_message_of_exactly_the_bound_is_kept_whole() -> None:
    assert exception_message(ValueError("y" * 500)) == "y" * 500


def test_an_unprintable_cause_is_rendered_in_the_typed_errors_message() -> None:
    error = raised_from(EnvStepError(turn=0, action_repr="'a'"), UnprintableError())
    assert (
        str(error)
        == "env step failed at turn 0 (action='a'): UnprintableError: <unprintable UnprintableError object>"
    )


def test_a_close_failure_that_cannot_be_printed_never_masks_the_step_error() -> None:
    step_cause = ConnectionError("sandbox connection dropped")
    inner = ScriptableEnv(step=raising(step_cause), close=raising(UnprintableError()))
    env = ResilientEnv(inner)
    env.reset()
    with pytest.raises(EnvStepError) as caught:
        env.step("ls")
    assert caught.value.__cause__ is step_cause
    assert (
        str(caught.value)
        == "env step failed at turn 0 (action='ls'): ConnectionError: sandbox connection dropped"
    )
    assert caught.value.__notes__ == [
        "env close failed: UnprintableError: <unprintable UnprintableError object>"
    ]
    assert isinstance(env.close_error, EnvCloseError)
    assert isinstance(env.close_error.__cause__, UnprintableError)
    assert inner.close_calls == 1


def test_an_unprintable_step_and_close_failure_still_give_the_typed_step_error() -> None:
    inner = ScriptableEnv(step=raising(NonStrError()), close=raising(UnprintableError()))
    env = ResilientEnv(inner)
    env.reset()
    with pytest.raises(EnvStepError) as caught:
        env.step("ls")
    assert (
        str(caught.value)
        == "env step failed at turn 0 (action='ls'): NonStrError: <unprintable NonStrError object>"
    )
    assert caught.value.__notes__ == [
        "env close failed: UnprintableError: <unprintable UnprintableError object>"
    ]


def test_an_unprintable_close_failure_at_garbage_collection_is_still_reported() -> None:
    inner = ScriptableEnv(close=raising(UnprintableError()))
    env = ResilientEnv(inner)
    with pytest.warns(
        ResourceWarning,
        match=r"; its close\(\) raised UnprintableError: <unprintable UnprintableError object>$",
    ):
        del env
        gc.collect()
    assert inner.close_calls == 1


# --- placeholders, failures and metrics carry the root cause -------------------------------------------


def dropping_connection(instance_ids: set[str]) -> Fault:
    return fail_on(instance_ids, turn=1, exc=ConnectionError, message="sandbox connection dropped")


async def test_a_placeholder_names_its_failure_and_the_root_cause_and_metrics_count_both() -> None:
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=3, max_tokens=12)
    runner = BatchRunner(ScriptedEngine(), factory(EnvCounts(), dropping_connection({"t1", "t4"})), config)
    result = await runner.generate(tasks(6))
    validate_batch_output(result.output, num_prompts=6)
    placeholder = result.trajectories[1]
    assert isinstance(placeholder, Trajectory) and placeholder.failure is not None
    failure = placeholder.failure
    assert (failure.error_type, failure.phase, failure.turn) == ("EnvStepError", "step", 1)
    step_error = result.failures[0].exception
    assert isinstance(step_error, EnvStepError)
    assert failure.message == (
        f"env step failed at turn 1 (action={step_error.action_repr}): "
        "ConnectionError: sandbox connection dropped"
    )
    assert (failure.root_cause_type, failure.root_cause_message) == (
        "ConnectionError",
        "sandbox connection dropped",
    )
    assert [f.rollout_index for f in result.failures] == [1, 4]
    assert all(type(root_cause(f.exception)) is ConnectionError for f in result.failures)
    assert result.metrics["rollout_errors/type/EnvStepError"] == 2.0
    assert result.metrics["rollout_errors/cause/ConnectionError"] == 2.0
    assert result.metrics["rollout_errors/phase/step"] == 2.0


def engine_failing_on(calls: set[int], error: Exception) -> ScriptedEngine:
    def script(prompt_ids: list[int], sampling: Sampling, call_index: int) -> Generation:
        if call_index in calls:
            raise error
        return echo_script(prompt_ids, sampling, call_index)

    return ScriptedEngine(script=script)


@pytest.mark.parametrize("error_type", [UnprintableError, NonStrError])
async def test_an_unprintable_engine_exception_under_skip_failed_rollouts_keeps_the_batch(
    error_type: type[Exception],
) -> None:
    ledger = EnvCounts()
    engine = engine_failing_on({0}, error_type())
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=2, max_tokens=12, max_concurrency=1)
    result = await BatchRunner(engine, factory(ledger), config).generate(tasks(4))
    validate_batch_output(result.output, num_prompts=4)
    assert [t.is_placeholder for t in result.trajectories] == [True, False, False, False]
    placeholder = result.trajectories[0]
    assert isinstance(placeholder, Trajectory) and placeholder.failure is not None
    name = error_type.__name__
    unprintable = f"<unprintable {name} object>"
    assert (placeholder.failure.error_type, placeholder.failure.message) == (name, unprintable)
    assert (placeholder.failure.root_cause_type, placeholder.failure.root_cause_message) == (
        name,
        unprintable,
    )
    assert (placeholder.failure.phase, placeholder.failure.turn) == ("generate", 0)
    assert result.metrics[f"rollout_errors/cause/{name}"] == 1.0
    assert ledger.open == 0


async def test_when_every_rollout_fails_unprintably_the_batch_error_still_renders() -> None:
    engine = engine_failing_on(set(range(3)), UnprintableError())
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=2, max_tokens=12)
    with pytest.raises(AllRolloutsFailedError) as caught:
        await BatchRunner(engine, factory(EnvCounts()), config).generate(tasks(3))
    assert str(caught.value) == (
        "all 3 rollouts failed; first: UnprintableError: <unprintable UnprintableError object>"
    )


async def test_an_unprintable_close_failure_after_an_engine_failure_is_a_note_on_that_failure() -> None:
    engine_error = RuntimeError("engine went away")
    engine = engine_failing_on({0}, engine_error)

    def env_factory(task: Task) -> ScriptableEnv:
        if task.instance_id == "t0":
            return ScriptableEnv(reset=lambda *_: ("go", {}), close=raising(UnprintableError()))
        return ScriptableEnv(reset=lambda *_: ("go", {}))

    config = RunnerConfig(skip_failed_rollouts=True, max_turns=1, max_tokens=12, max_concurrency=1)
    result = await BatchRunner(engine, env_factory, config).generate(tasks(2))
    failure = result.failures[0]
    assert failure.exception is engine_error
    assert engine_error.__notes__ == [
        "closing the env also failed: UnprintableError: <unprintable UnprintableError object>"
    ]
