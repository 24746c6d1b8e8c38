"""RetryPolicy and the transience rules it retries by default: which failures another attempt may fix."""

from __future__ import annotations

import asyncio

import pytest

from gym_resilience.errors import (
    EngineDeadError,
    EngineError,
    EngineRequestError,
    EnvStepError,
    EnvTimeoutError,
    RolloutTimeoutError,
    UnsupportedConfigError,
)
from gym_resilience.retry import TRANSIENT_ERRORS, RetryPolicy, is_transient, is_transient_status


def _wrapped(cause: BaseException) -> BaseException:
    """An ``EnvStepError`` caused by ``cause``, as a rollout's failure arrives."""
    error = EnvStepError(turn=1, action_repr="'ls'")
    error.__cause__ = cause
    return error


@pytest.mark.parametrize(
    "error",
    [
        ConnectionResetError("peer reset"),
        TimeoutError("too slow"),
        EnvTimeoutError(operation="step", timeout_s=2.5),
        RolloutTimeoutError(rollout_index=1, phase="step", turn=None, elapsed_s=30.5, timeout_s=30.0),
        _wrapped(BrokenPipeError("pipe")),
    ],
)
def test_connection_errors_and_timeouts_are_transient_wherever_they_are_in_the_cause_chain(
    error: BaseException,
) -> None:
    assert is_transient(error)


@pytest.mark.parametrize(
    "error",
    [
        ValueError("bad action"),
        _wrapped(KeyError("missing")),
        EngineError("the server answered garbage"),
        EngineRequestError("prompt too long"),
    ],
)
def test_other_errors_engine_errors_alone_included_are_not_transient(error: BaseException) -> None:
    assert not is_transient(error)


def test_an_engine_error_caused_by_a_refused_connection_is_transient() -> None:
    error = EngineDeadError("every endpoint is down")
    error.__cause__ = ConnectionRefusedError("refused")
    assert is_transient(error)


def test_is_transient_takes_the_kinds_to_look_for_and_survives_a_cause_cycle() -> None:
    first, second = ValueError("a"), KeyError("b")
    first.__cause__, second.__cause__ = second, first
    assert is_transient(first, (KeyError,))
    assert not is_transient(first)


@pytest.mark.parametrize("status", [500, 503, 408, 429])
def test_server_errors_timeouts_and_overload_statuses_are_transient(status: int) -> None:
    assert is_transient_status(status)


@pytest.mark.parametrize("status", [200, 400, 404, 413, 422])
def test_success_and_statuses_that_blame_the_request_are_not_transient(status: int) -> None:
    assert not is_transient_status(status)


def test_the_default_policy_retries_exactly_the_transient_errors() -> None:
    assert RetryPolicy().retry_on == TRANSIENT_ERRORS == (ConnectionError, TimeoutError)


def test_the_delay_doubles_from_the_initial_delay_adds_the_jitter_draw_and_stops_at_the_cap() -> None:
    policy = RetryPolicy(initial_delay_s=0.5, max_delay_s=3.0, jitter_s=0.5)
    assert [policy.delay_s(attempt) for attempt in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 3.0]
    assert policy.delay_s(1, jitter=1.0) == 1.0
    assert policy.delay_s(10_000) == 3.0  # past float range: the cap, not an OverflowError


def test_a_cancellation_is_never_retryable_whatever_its_cause() -> None:
    cancelled = asyncio.CancelledError()
    cancelled.__cause__ = ConnectionError("refused")
    policy = RetryPolicy()
    assert not policy.is_retryable(cancelled)
    assert policy.is_retryable(_wrapped(ConnectionError("refused")))


def test_retrying_runs_until_the_call_succeeds_and_sleeps_between_attempts() -> None:
    slept: list[float] = []
    outcomes: list[Exception | str] = [ConnectionError("1"), TimeoutError("2"), "done"]

    def flaky() -> str:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    policy = RetryPolicy(attempts=3, initial_delay_s=0.1, jitter_s=0.0, sleep=slept.append)
    assert policy.retrying()(flaky) == "done"
    assert slept == [0.1, 0.2]


def test_the_last_error_is_raised_as_itself_once_the_attempts_are_spent() -> None:
    calls = 0

    def refused() -> None:
        nonlocal calls
        calls += 1
        raise ConnectionRefusedError(f"attempt {calls}")

    policy = RetryPolicy(attempts=2, sleep=lambda _s: None)
    with pytest.raises(ConnectionRefusedError, match=r"^attempt 2$"):
        policy.retrying()(refused)
    assert calls == 2


def test_an_error_that_is_not_transient_is_raised_at_once() -> None:
    calls: list[int] = []

    def bad() -> None:
        calls.append(1)
        raise ValueError("bad action")

    with pytest.raises(ValueError, match="bad action"):
        RetryPolicy(sleep=lambda _s: None).retrying()(bad)
    assert calls == [1]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"attempts": 0}, "must be an int >= 1, got 0"),
        ({"initial_delay_s": 2.0, "max_delay_s": 1.0}, "must be >= initial_delay_s (2), got 1"),
        ({"retry_on": (KeyboardInterrupt,)}, "must be a tuple of Exception subclasses"),
    ],
)
def test_a_policy_that_cannot_work_is_refused_when_it_is_made(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(UnsupportedConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RetryPolicy(**options)  # type: ignore[arg-type]
