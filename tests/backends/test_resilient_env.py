"""ResilientEnv: close exactly once on every exit path, typed errors, reset retries."""

from __future__ import annotations

import asyncio
import copy
import gc
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import gymnasium
import pytest

from gym_resilience.backends.resilient import ResilientEnv
from gym_resilience.errors import (
    EnvClosedError,
    EnvCloseError,
    EnvResetError,
    EnvStepError,
    UnsupportedConfigError,
)
from gym_resilience.retry import RetryPolicy
from gym_resilience.testing import ScriptableEnv, default_reset, echo_step, flaky


def raising(error: BaseException) -> Any:
    """A behaviour that raises ``error`` (the same object) whatever it is called with."""

    def behaviour(*_args: Any) -> Any:
        raise error

    return behaviour


def no_sleep_policy(attempts: int = 3, **kwargs: Any) -> tuple[RetryPolicy, list[float]]:
    slept: list[float] = []
    return RetryPolicy(attempts=attempts, sleep=slept.append, **kwargs), slept


# --- close runs exactly once on every exit path ------------------------------------------------------


def test_normal_end_closes_the_inner_env_once_however_often_close_is_called() -> None:
    inner = ScriptableEnv()
    env = ResilientEnv(inner)
    env.reset(seed=0)
    env.step("hello")
    env.close()
    env.close()
    env.close()
    assert inner.close_calls == 1
    assert env.closed


def test_an_exception_in_reset_closes_the_inner_env_before_the_typed_error_propagates() -> None:
    cause = RuntimeError("reset exploded")
    inner = ScriptableEnv(reset=raising(cause))
    env = ResilientEnv(inner)
    with pytest.raises(EnvResetError) as caught:
        env.reset()
    assert caught.value.__cause__ is cause
    assert caught.value.attempts == 1
    assert str(caught.value) == "env reset failed: RuntimeError: reset exploded"
    assert inner.close_calls == 1
    env.close()
    assert inner.close_calls == 1


def test_an_exception_in_step_closes_the_inner_env_before_the_typed_error_propagates() -> None:
    cause = ValueError("bad move")
    inner = ScriptableEnv(step=raising(cause))
    env = ResilientEnv(inner)
    env.reset()
    with pytest.raises(EnvStepError) as caught:
        env.step("move e2e4")
    assert caught.value.__cause__ is cause
    assert inner.close_calls == 1
    env.close()
    assert inner.close_calls == 1


def test_step_error_names_the_turn_since_the_last_reset_and_the_action() -> None:
    inner = ScriptableEnv(step=flaky(echo_step, ConnectionError("blip"), calls={3}))
    env = ResilientEnv(inner, close_on_error=False)
    env.reset()
    env.step("a")
    env.step("b")
    env.reset()  # the turn counts from the last reset, not from the first
    env.step("c")
    with pytest.raises(EnvStepError) as caught:
        env.step("go north")
    assert caught.value.turn == 1
    assert caught.value.action_repr == "'go north'"
    assert str(caught.value) == "env step failed at turn 1 (action='go north'): ConnectionError: blip"


def test_step_error_truncates_a_long_action_repr() -> None:
    env = ResilientEnv(ScriptableEnv(step=raising(RuntimeError("no"))))
    env.reset()
    with pytest.raises(EnvStepError) as caught:
        env.step("x" * 10_000)
    assert len(caught.value.action_repr) <= 60
    assert "..." in caught.value.action_repr


def test_step_error_survives_an_action_whose_repr_raises() -> None:
    class Unprintable:
        def __repr__(self) -> str:
            raise RuntimeError("no repr for you")

    env = ResilientEnv(ScriptableEnv(step=raising(RuntimeError("no"))))
    env.reset()
    with pytest.raises(EnvStepError) as caught:
        env.step(Unprintable())
    assert caught.value.action_repr.startswith("<Unprintable instance at 0x")
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_errors_name_the_env_id_when_the_env_has_a_spec() -> None:
    inner = gymnasium.make("CartPole-v1")
    env = ResilientEnv(inner)
    env.close()
    with pytest.raises(EnvClosedError) as caught:
        env.step(0)
    assert caught.value.env_id == "CartPole-v1"
    assert str(caught.value) == "cannot step: the env is closed [CartPole-v1]"


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, asyncio.CancelledError, SystemExit])
def test_an_interruption_in_step_propagates_unchanged_and_closes_the_inner_env(
    interruption: type[BaseException],
) -> None:
    raised = interruption()
    inner = ScriptableEnv(step=raising(raised))
    env = ResilientEnv(inner, close_on_error=False)  # interruptions close regardless
    env.reset()
    with pytest.raises(interruption) as caught:
        env.step("wait")
    assert caught.value is raised
    assert not hasattr(caught.value, "__notes__")
    assert inner.close_calls == 1
    env.close()
    assert inner.close_calls == 1


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, asyncio.CancelledError])
@pytest.mark.parametrize("retry", [False, True])
def test_an_interruption_in_reset_propagates_unchanged_and_closes_the_inner_env(
    interruption: type[BaseException], retry: bool
) -> None:
    raised = interruption()
    inner = ScriptableEnv(reset=raising(raised))
    env = ResilientEnv(inner, close_on_error=False, reset_retry=no_sleep_policy()[0] if retry else None)
    with pytest.raises(interruption) as caught:
        env.reset()
    assert caught.value is raised
    assert inner.reset_calls == 1  # never retried
    assert inner.close_calls == 1


async def test_cancelling_a_task_between_steps_inside_a_with_block_closes_the_inner_env() -> None:
    inner = ScriptableEnv()
    stepped = asyncio.Event()

    async def rollout() -> None:
        with ResilientEnv(inner) as env:
            env.reset()
            env.step("first")
            stepped.set()
            await asyncio.Event().wait()  # the task is cancelled here
            env.step("never")

    task = asyncio.create_task(rollout())
    await stepped.wait()
    assert inner.close_calls == 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert inner.close_calls == 1
    assert inner.step_calls == 1


async def test_cancelled_error_raised_by_step_in_a_task_propagates_unchanged_and_closes_the_env() -> None:
    cancelled = asyncio.CancelledError()
    inner = ScriptableEnv(step=raising(cancelled))
    env = ResilientEnv(inner, close_on_error=False)

    async def rollout() -> None:
        env.reset()
        await asyncio.sleep(0)
        env.step("go")

    task = asyncio.create_task(rollout())
    with pytest.raises(asyncio.CancelledError) as caught:
        await task
    assert caught.value is cancelled
    assert inner.close_calls == 1


def test_leaving_a_with_block_by_exception_closes_the_inner_env_and_propagates_the_exception() -> None:
    inner = ScriptableEnv()
    failure = LookupError("agent crashed")
    with pytest.raises(LookupError) as caught, ResilientEnv(inner) as env:
        env.reset()
        raise failure
    assert caught.value is failure
    assert inner.close_calls == 1


def test_leaving_a_with_block_normally_closes_the_inner_env() -> None:
    inner = ScriptableEnv()
    with ResilientEnv(inner) as env:
        env.reset()
    assert inner.close_calls == 1
    assert env.__exit__(None, None, None) is False
    assert inner.close_calls == 1


def test_garbage_collection_closes_the_inner_env_once_with_a_resource_warning() -> None:
    inner = ScriptableEnv()
    env = ResilientEnv(inner)
    env.reset()
    collected = weakref.ref(env)
    with pytest.warns(ResourceWarning, match=r"^unclosed ResilientEnv around .* garbage collector$"):
        del env
        gc.collect()
    assert collected() is None
    assert inner.close_calls == 1


def test_garbage_collection_after_close_does_not_close_again() -> None:
    inner = ScriptableEnv()
    env = ResilientEnv(inner)
    env.close()
    del env
    gc.collect()
    assert inner.close_calls == 1


def test_the_finalizer_does_not_keep_the_wrapper_alive() -> None:
    env = ResilientEnv(ScriptableEnv())
    collected = weakref.ref(env)
    env.close()
    del env
    assert collected() is None  # reference counting alone frees it: no cycle through the finalizer


def test_interpreter_exit_without_close_closes_the_inner_env_exactly_once() -> None:
    script = textwrap.dedent(
        """
        from gym_resilience.backends.resilient import ResilientEnv
        from gym_resilience.testing import ScriptableEnv

        env = ResilientEnv(ScriptableEnv(close=lambda inner: print("inner close ran", flush=True)))
        env.reset()
        env.step("hello")
        print("exiting without close", flush=True)
        """
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout == "exiting without close\ninner close ran\n"


# --- close failures ----------------------------------------------------------------------------------


def test_close_raising_alone_raises_env_close_error_with_the_cause() -> None:
    cause = OSError("socket already gone")
    inner = ScriptableEnv(close=raising(cause))
    env = ResilientEnv(inner)
    with pytest.raises(EnvCloseError) as caught:
        env.close()
    assert caught.value.__cause__ is cause
    assert str(caught.value) == "env close failed: OSError: socket already gone"
    assert env.close_error is caught.value
    assert env.closed
    env.close()  # the env counts as closed: no second attempt, no second error
    assert inner.close_calls == 1


def test_close_raising_while_a_step_error_propagates_is_a_note_on_the_step_error() -> None:
    step_cause = ConnectionError("tool server went away")
    close_cause = OSError("socket already gone")
    inner = ScriptableEnv(step=raising(step_cause), close=raising(close_cause))
    env = ResilientEnv(inner)
    env.reset()
    with pytest.raises(EnvStepError) as caught:
        env.step("ls")
    assert caught.value.__cause__ is step_cause
    assert caught.value.__notes__ == ["env close failed: OSError: socket already gone"]
    assert env.close_error is not None
    assert env.close_error.__cause__ is close_cause
    assert inner.close_calls == 1
    env.close()
    assert inner.close_calls == 1


def test_close_raising_while_a_keyboard_interrupt_propagates_is_a_note_on_the_interrupt() -> None:
    interrupt = KeyboardInterrupt()
    inner = ScriptableEnv(step=raising(interrupt), close=raising(OSError("gone")))
    env = ResilientEnv(inner)
    env.reset()
    with pytest.raises(KeyboardInterrupt) as caught:
        env.step("ls")
    assert caught.value is interrupt
    assert caught.value.__notes__ == ["env close failed: OSError: gone"]
    assert isinstance(env.close_error, EnvCloseError)


def test_close_raising_while_an_exception_leaves_a_with_block_is_a_note_on_that_exception() -> None:
    inner = ScriptableEnv(close=raising(OSError("gone")))
    failure = LookupError("agent crashed")
    with pytest.raises(LookupError) as caught, ResilientEnv(inner) as env:
        raise failure
    assert caught.value is failure
    assert caught.value.__notes__ == ["env close failed: OSError: gone"]
    assert isinstance(env.close_error, EnvCloseError)
    assert inner.close_calls == 1


def test_close_raising_when_a_with_block_ends_normally_raises_env_close_error() -> None:
    cause = OSError("gone")
    inner = ScriptableEnv(close=raising(cause))
    with pytest.raises(EnvCloseError) as caught, ResilientEnv(inner):
        pass
    assert caught.value.__cause__ is cause
    assert inner.close_calls == 1


def test_close_raising_at_garbage_collection_is_reported_in_the_resource_warning() -> None:
    inner = ScriptableEnv(close=raising(OSError("gone")))
    env = ResilientEnv(inner)
    with pytest.warns(ResourceWarning, match=r"; its close\(\) raised OSError: gone$"):
        del env
        gc.collect()
    assert inner.close_calls == 1


# --- use after close ---------------------------------------------------------------------------------


@pytest.mark.parametrize("operation", ["reset", "step", "render"])
def test_using_the_env_after_close_raises_env_closed_error(operation: str) -> None:
    inner = ScriptableEnv(render_mode="ansi")
    env = ResilientEnv(inner)
    env.reset()
    env.close()
    calls: dict[str, Callable[[], object]] = {
        "reset": env.reset,
        "step": lambda: env.step("x"),
        "render": env.render,
    }
    with pytest.raises(EnvClosedError) as caught:
        calls[operation]()
    assert str(caught.value) == f"cannot {operation}: the env is closed"
    assert caught.value.operation == operation
    assert caught.value.__cause__ is None
    assert (inner.reset_calls, inner.step_calls) == (1, 0)


def test_step_after_a_step_error_raises_env_closed_error() -> None:
    env = ResilientEnv(ScriptableEnv(step=raising(RuntimeError("broken"))))
    env.reset()
    with pytest.raises(EnvStepError):
        env.step("a")
    with pytest.raises(EnvClosedError, match=r"^cannot step: the env is closed$"):
        env.step("b")


def test_close_on_error_false_leaves_the_env_open_after_a_step_error() -> None:
    inner = ScriptableEnv(step=flaky(echo_step, RuntimeError("once"), calls={0}))
    env = ResilientEnv(inner, close_on_error=False)
    env.reset()
    with pytest.raises(EnvStepError):
        env.step("a")
    assert inner.close_calls == 0
    assert not env.closed
    assert env.step("b")[0] == "b"
    env.close()
    assert inner.close_calls == 1


def test_close_on_error_false_leaves_the_env_open_after_a_reset_error() -> None:
    inner = ScriptableEnv(reset=flaky(default_reset, RuntimeError("once"), calls={0}))
    env = ResilientEnv(inner, close_on_error=False)
    with pytest.raises(EnvResetError):
        env.reset()
    assert inner.close_calls == 0
    assert env.reset() == ("Say something.", {})
    env.close()
    assert inner.close_calls == 1


# --- reset retries -----------------------------------------------------------------------------------


def test_reset_retries_a_transient_error_and_succeeds_on_the_same_env() -> None:
    policy, slept = no_sleep_policy(attempts=3, initial_delay_s=0.25, jitter_s=0.0)
    inner = ScriptableEnv(reset=flaky(default_reset, ConnectionError, calls=range(2)))
    env = ResilientEnv(inner, reset_retry=policy)
    assert env.reset(seed=1) == ("Say something.", {})
    assert inner.reset_calls == 3
    assert slept == [0.25, 0.5]
    assert inner.close_calls == 0
    env.close()


def test_reset_does_not_retry_an_error_that_is_not_transient() -> None:
    cause = ValueError("bad options")
    policy, slept = no_sleep_policy(attempts=3)
    inner = ScriptableEnv(reset=raising(cause))
    env = ResilientEnv(inner, reset_retry=policy)
    with pytest.raises(EnvResetError) as caught:
        env.reset()
    assert caught.value.__cause__ is cause
    assert caught.value.attempts == 1
    assert inner.reset_calls == 1
    assert slept == []
    assert inner.close_calls == 1


def test_reset_that_keeps_failing_raises_env_reset_error_after_all_attempts() -> None:
    policy, slept = no_sleep_policy(attempts=3)
    errors = [ConnectionError(f"refused {n}") for n in range(3)]

    def reset(env: ScriptableEnv, seed: int | None, options: dict[str, Any] | None) -> Any:
        raise errors[env.reset_calls - 1]

    inner = ScriptableEnv(reset=reset)
    env = ResilientEnv(inner, reset_retry=policy)
    with pytest.raises(EnvResetError) as caught:
        env.reset()
    assert caught.value.attempts == 3
    assert str(caught.value) == "env reset failed after 3 attempts: ConnectionError: refused 2"
    assert caught.value.__cause__ is errors[-1]
    assert inner.reset_calls == 3
    assert len(slept) == 2
    assert inner.close_calls == 1


def test_step_is_never_retried_even_with_a_reset_retry_policy() -> None:
    policy, _ = no_sleep_policy(attempts=5)
    inner = ScriptableEnv(step=raising(ConnectionError("blip")))
    env = ResilientEnv(inner, reset_retry=policy)
    env.reset()
    with pytest.raises(EnvStepError):
        env.step("a")
    assert inner.step_calls == 1


# --- retry policy ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attempts": 0}, "RetryPolicy.attempts: must be an int >= 1, got 0"),
        ({"attempts": True}, "RetryPolicy.attempts: must be an int >= 1, got True"),
        (
            {"initial_delay_s": -1},
            "RetryPolicy.initial_delay_s: must be a finite number of seconds >= 0, got -1",
        ),
        (
            {"jitter_s": float("nan")},
            "RetryPolicy.jitter_s: must be a finite number of seconds >= 0, got nan",
        ),
        (
            {"total_delay_s": -0.5},
            "RetryPolicy.total_delay_s: must be None or a finite number of seconds >= 0, got -0.5",
        ),
        (
            {"initial_delay_s": 5, "max_delay_s": 1},
            "RetryPolicy.max_delay_s: must be >= initial_delay_s (5), got 1",
        ),
        (
            {"retry_on": (KeyboardInterrupt,)},
            "RetryPolicy.retry_on: must be a tuple of Exception subclasses (never BaseException), "
            "got (<class 'KeyboardInterrupt'>,)",
        ),
    ],
)
def test_retry_policy_rejects_invalid_arguments_with_a_clear_value_error(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as caught:
        RetryPolicy(**kwargs)
    assert isinstance(caught.value, UnsupportedConfigError)
    assert str(caught.value) == message


def test_retry_policy_retries_connection_and_timeout_errors_by_default() -> None:
    policy = RetryPolicy()
    assert policy.is_retryable(ConnectionResetError())
    assert policy.is_retryable(TimeoutError())
    assert not policy.is_retryable(ValueError())
    assert not policy.is_retryable(KeyboardInterrupt())


def test_retry_policy_delays_grow_exponentially_up_to_the_cap() -> None:
    policy = RetryPolicy(initial_delay_s=0.5, max_delay_s=3.0, jitter_s=1.0)
    assert [policy.delay_s(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert policy.delay_s(1, jitter=1.0) == 1.5
    assert policy.delay_s(10_000) == 3.0


def test_retry_policy_sleeps_tenacity_delays_within_the_jitter_bound() -> None:
    policy, slept = no_sleep_policy(attempts=4, initial_delay_s=0.1, max_delay_s=0.3, jitter_s=0.05)
    with pytest.raises(ConnectionError):
        policy.retrying()(raising(ConnectionError("down")))
    assert len(slept) == 3
    for attempt, delay in enumerate(slept, start=1):
        assert policy.delay_s(attempt) <= delay <= policy.delay_s(attempt, jitter=1.0)


def test_retry_policy_stops_before_the_total_delay_budget_is_exceeded() -> None:
    budgeted, slept = no_sleep_policy(
        attempts=10, initial_delay_s=1.0, max_delay_s=1.0, jitter_s=0.0, total_delay_s=0.5
    )
    calls = 0

    def down() -> None:
        nonlocal calls
        calls += 1
        raise ConnectionError("down")

    with pytest.raises(ConnectionError):
        budgeted.retrying()(down)
    assert calls == 1  # the first retry would start 1 s in, past the 0.5 s budget
    assert slept == []


async def test_retry_policy_async_retrying_retries_a_coroutine_with_the_injected_async_sleep() -> None:
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    policy = RetryPolicy(attempts=3, jitter_s=0.0, initial_delay_s=0.1, async_sleep=fake_sleep)
    calls = 0

    async def rollout() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise TimeoutError("slow")
        return "done"

    assert await policy.async_retrying()(rollout) == "done"
    assert slept == [0.1, 0.2]


def test_retry_policy_is_a_frozen_picklable_value() -> None:
    policy = RetryPolicy(attempts=5)
    assert pickle.loads(pickle.dumps(policy)) == policy
    with pytest.raises(AttributeError):
        policy.attempts = 2  # type: ignore[misc]


# --- pass-through ------------------------------------------------------------------------------------


def test_spaces_metadata_render_unwrapped_and_spec_pass_through() -> None:
    inner = gymnasium.make("CartPole-v1", render_mode="rgb_array")
    env = ResilientEnv(inner)
    assert env.action_space is inner.action_space
    assert env.observation_space is inner.observation_space
    assert env.metadata is inner.metadata
    assert env.render_mode == "rgb_array"
    assert env.unwrapped is inner.unwrapped
    assert env.spec is not None
    assert env.spec.id == "CartPole-v1"
    assert env.spec.additional_wrappers[-1].name == "ResilientEnv"
    env.reset(seed=0)
    frame = env.render()
    assert frame is not None
    env.close()


def test_the_spec_recreates_the_wrapper_with_its_options() -> None:
    policy = RetryPolicy(attempts=2)
    env = ResilientEnv(gymnasium.make("CartPole-v1"), close_on_error=False, reset_retry=policy)
    remade = env.spec.make() if env.spec is not None else None
    assert isinstance(remade, ResilientEnv)
    assert remade.close_on_error is False
    assert remade.reset_retry == policy
    env.close()
    remade.close()


def test_a_text_env_round_trips_strings_through_the_wrapper() -> None:
    with ResilientEnv(ScriptableEnv()) as env:
        assert env.reset(seed=3) == ("Say something.", {})
        observation, reward, terminated, truncated, info = env.step("ls -la")
    assert (observation, reward, terminated, truncated, info) == ("ls -la", 0.0, False, False, {})


def test_wrapping_something_that_is_not_an_env_raises_type_error() -> None:
    with pytest.raises(TypeError):
        ResilientEnv("not an env")  # type: ignore[arg-type]


def test_close_requested_from_many_threads_at_once_closes_the_inner_env_once() -> None:
    start = threading.Barrier(8)
    inner = ScriptableEnv(close=lambda _env: time.sleep(0.01))
    env = ResilientEnv(inner)

    def request_close() -> None:
        start.wait()
        env.close()

    threads = [threading.Thread(target=request_close) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert inner.close_calls == 1


# --- options, copies and counting ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"reset_retry": 3}, "reset_retry"),
        ({"reset_retry": True}, "reset_retry"),
        ({"reset_retry": {"attempts": 3}}, "reset_retry"),
        ({"close_on_error": "no"}, "close_on_error"),
        ({"close_on_error": None}, "close_on_error"),
    ],
)
def test_an_option_of_the_wrong_type_is_refused_when_the_wrapper_is_made_and_the_env_is_closed(
    kwargs: dict[str, Any], option: str
) -> None:
    inner = ScriptableEnv()
    with pytest.raises(UnsupportedConfigError) as caught:
        ResilientEnv(inner, **kwargs)
    assert caught.value.option == option
    assert repr(kwargs[option]) in str(caught.value)
    assert inner.close_calls == 1  # handed over: refused, it is closed all the same


def test_a_refused_env_whose_close_raises_says_so_on_the_refusal() -> None:
    inner = ScriptableEnv(close=raising(OSError("sandbox already gone")))
    with pytest.raises(UnsupportedConfigError) as caught:
        ResilientEnv(inner, step_timeout=5.0)
    assert caught.value.__notes__ == ["closing the env also failed: OSError: sandbox already gone"]


def test_the_turn_of_a_step_error_counts_failed_steps_and_starts_over_at_each_reset() -> None:
    def reset(env: ScriptableEnv, seed: int | None, options: dict[str, Any] | None) -> Any:
        if env.reset_calls == 2:
            raise ConnectionError("sandbox gone")
        return default_reset(env, seed, options)

    env = ResilientEnv(ScriptableEnv(reset=reset, step=raising(ValueError("bad move"))), close_on_error=False)
    env.reset()
    turns = []
    for _ in range(3):
        with pytest.raises(EnvStepError) as caught:
            env.step("e2e4")
        turns.append(caught.value.turn)
    assert turns == [0, 1, 2]
    with pytest.raises(EnvResetError):
        env.reset()
    with pytest.raises(EnvStepError) as caught:
        env.step("e2e4")
    assert caught.value.turn == 0  # a reset, even a failed one, starts the count over


def test_a_render_failure_passes_through_unchanged_and_an_interruption_in_render_closes_the_env() -> None:
    inner = ScriptableEnv()
    env = ResilientEnv(inner)
    inner.render = raising(RuntimeError("no display"))  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match=r"^no display$"):
        env.render()
    assert not env.closed
    inner.render = raising(KeyboardInterrupt())  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        env.render()
    assert env.closed and inner.close_calls == 1


@pytest.mark.parametrize(
    "duplicate",
    [copy.copy, copy.deepcopy, pickle.dumps],
    ids=["copy", "deepcopy", "pickle"],
)
def test_a_wrapper_cannot_be_copied_or_pickled_so_its_one_close_is_never_shared(
    duplicate: Callable[[Any], Any],
) -> None:
    inner = ScriptableEnv()
    env = ResilientEnv(inner)
    with pytest.raises(TypeError, match=r"^a ResilientEnv cannot be copied or pickled"):
        duplicate(env)
    assert not env.closed
    env.close()
    assert inner.close_calls == 1
