"""Isolated envs: typed errors across the process boundary (the env's own exceptions, those that cannot
cross, a failing close) and the configuration an isolated env refuses."""

from __future__ import annotations

import functools
import threading
from typing import Any

import gymnasium
import pytest
from doubles import Fault, SandboxError, env_fn, resilient_env_of, tasks, tool_exited_2
from isolation_helpers import HANGING_RESET, HANGING_STEP, timed, worker_of

from gym_resilience.backends.choice import make_env
from gym_resilience.backends.process import IsolatedEnv
from gym_resilience.backends.resilient import ResilientEnv
from gym_resilience.config import RunnerConfig
from gym_resilience.errors import (
    EnvClosedError,
    EnvCloseError,
    EnvStepError,
    EnvTimeoutError,
    UnpicklableEnvError,
    UnsupportedConfigError,
    root_cause,
)
from gym_resilience.retry import RetryPolicy
from gym_resilience.testing import ScriptableEnv

TASK = tasks(1)[0]
FAILING_STEP = env_fn(Fault(error=ValueError, message="bad move"))


# --- errors raised in the worker ---------------------------------------------------------------------


def test_an_exception_in_the_worker_step_arrives_as_env_step_error_with_the_original_as_cause() -> None:
    env = ResilientEnv.isolated(FAILING_STEP)
    worker = worker_of(env)
    env.reset()
    with pytest.raises(EnvStepError) as caught:
        env.step("e2e4")
    assert str(caught.value) == "env step failed at turn 0 (action='e2e4'): ValueError: bad move"
    cause = caught.value.__cause__
    assert type(cause) is ValueError
    assert str(cause) == "bad move"
    # The worker's traceback travels as a note: the parent's own traceback ends in the pipe.
    assert cause.__notes__[0].startswith(f"raised in the env's worker process (pid {worker.pid}):\nTraceback")
    assert "in fire" in cause.__notes__[0]
    assert env.closed
    assert not worker.is_running()


def test_a_transient_failure_of_a_wrapped_env_in_a_worker_is_still_transient_in_the_parent() -> None:
    """A factory that returns a ResilientEnv (for reset retries) runs it in the worker, whose EnvStepError
    crosses the pipe with its ConnectionError as cause: retries still see a transient failure."""
    failing = env_fn(Fault(error=ConnectionError, message="sandbox connection dropped"))
    config = RunnerConfig(env_backend="process")
    env = make_env(functools.partial(resilient_env_of, failing), tasks(1)[0], config).env
    env.reset()
    with pytest.raises(EnvStepError) as caught:
        env.step("ls")
    assert RetryPolicy().is_retryable(caught.value)
    assert type(root_cause(caught.value)) is ConnectionError
    assert str(caught.value).endswith(": ConnectionError: sandbox connection dropped")
    env.close()


def test_an_isolated_env_under_a_gymnasium_wrapper_still_counts_as_isolated() -> None:
    """A worker lost under a TimeLimit is closed and never retried, even with close_on_error=False."""
    policy = RetryPolicy(attempts=3, retry_on=(TimeoutError, EnvClosedError), sleep=lambda _s: None)
    wrapped = gymnasium.wrappers.TimeLimit(IsolatedEnv(HANGING_RESET, reset_timeout=0.3), 10)
    env = ResilientEnv(wrapped, reset_retry=policy)
    error, _ = timed(env.reset)
    assert isinstance(error, EnvTimeoutError)  # not a retry finding the env closed
    assert env.closed
    hanging = gymnasium.wrappers.TimeLimit(IsolatedEnv(HANGING_STEP, step_timeout=0.3), 10)
    env = ResilientEnv(hanging, close_on_error=False)
    env.reset()
    error, _ = timed(lambda: env.step("sleep forever"))
    assert isinstance(error, EnvTimeoutError)
    assert env.closed  # no env is left to keep open


def test_close_on_error_false_keeps_an_isolated_env_open_after_a_step_error() -> None:
    env = ResilientEnv.isolated(FAILING_STEP, close_on_error=False)
    env.reset()
    with pytest.raises(EnvStepError):
        env.step("e2e4")
    assert not env.closed
    assert env.reset() == (TASK.prompt, {})
    env.close()


@pytest.mark.parametrize(
    ("fault", "type_name", "message", "reason"),
    [
        pytest.param(
            Fault(error=SandboxError, message="container 3f2a is gone"),
            "doubles.SandboxError",
            "container 3f2a is gone",
            "TypeError: cannot pickle '_thread.lock' object",
            id="does-not-pickle",
        ),
        pytest.param(
            Fault(error=tool_exited_2, message="pytest"),
            "doubles.ToolError",
            "pytest exited with 2",
            "TypeError: ToolError.__init__() missing 1 required positional argument: 'code'",
            id="does-not-unpickle",
        ),
    ],
)
def test_an_exception_that_cannot_cross_arrives_as_unpicklable_env_error_with_its_type_and_message(
    fault: Fault, type_name: str, message: str, reason: str
) -> None:
    env = ResilientEnv.isolated(env_fn(fault))
    env.reset()
    with pytest.raises(EnvStepError) as caught:
        env.step("run")
    cause = caught.value.__cause__
    assert isinstance(cause, UnpicklableEnvError)
    assert (cause.type_name, cause.message, cause.reason) == (type_name, message, reason)
    assert str(cause) == f"{type_name}: {message} (it could not be pickled: {reason})"
    assert "Traceback" in cause.__notes__[0]


def test_a_step_result_that_cannot_be_pickled_is_a_step_error() -> None:
    env = ResilientEnv.isolated(env_fn(Fault(kind="unpicklable")))
    env.reset()
    with pytest.raises(EnvStepError) as caught:
        env.step("lock")
    assert type(caught.value.__cause__) is TypeError
    assert str(caught.value.__cause__) == "cannot pickle '_thread.lock' object"


def test_an_action_that_cannot_be_pickled_is_a_step_error_and_never_reaches_the_worker() -> None:
    env = ResilientEnv.isolated(env_fn(), close_on_error=False)
    env.reset()
    with pytest.raises(EnvStepError) as caught:
        env.step(threading.Lock())
    assert type(caught.value.__cause__) is TypeError
    # The protocol is intact, and the env's first step is still to come.
    assert env.step("still there")[0] == [{"role": "user", "content": "turn 1 done"}]
    env.close()


def test_a_keyboard_interrupt_raised_by_the_env_in_the_worker_propagates_unchanged_and_closes_the_env() -> (
    None
):
    env = ResilientEnv.isolated(
        env_fn(Fault(error=KeyboardInterrupt)),
        close_on_error=False,  # interruptions close regardless, as in-process
    )
    worker = worker_of(env)
    env.reset()
    with pytest.raises(KeyboardInterrupt):
        env.step("^C")
    assert env.closed
    assert not worker.is_running()


def test_a_failing_close_in_the_worker_raises_env_close_error_with_the_original_as_cause() -> None:
    env = ResilientEnv.isolated(env_fn(Fault(phase="close", error=OSError, message="socket already gone")))
    worker = worker_of(env)
    with pytest.raises(EnvCloseError) as caught:
        env.close()
    assert type(caught.value.__cause__) is OSError
    assert str(caught.value.__cause__) == "socket already gone"
    assert not worker.is_running()


# --- configuration -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [("step_timeout", 5.0), ("reset_timeout", 5.0), ("start_timeout", 5.0), ("close_timeout", 1.0)],
)
def test_a_deadline_without_isolation_raises_unsupported_config_error(option: str, value: float) -> None:
    kwargs: dict[str, Any] = {option: value}
    with pytest.raises(UnsupportedConfigError) as caught:
        ResilientEnv(ScriptableEnv(), **kwargs)
    assert str(caught.value) == (
        f"{option}: needs ResilientEnv.isolated: a deadline is kept by killing the process that runs the "
        "env, and a thread cannot be stopped"
    )
    assert caught.value.option == option
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"step_timeout": 0}, "step_timeout: must be None or a finite number of seconds > 0, got 0"),
        ({"reset_timeout": -1.0}, "reset_timeout: must be None or a finite number of seconds > 0, got -1.0"),
        (
            {"start_timeout": float("inf")},
            "start_timeout: must be None or a finite number of seconds > 0, got inf",
        ),
        ({"step_timeout": True}, "step_timeout: must be None or a finite number of seconds > 0, got True"),
        ({"close_timeout": None}, "close_timeout: must be a finite number of seconds > 0, got None"),
    ],
)
def test_isolation_rejects_a_timeout_that_is_not_a_number_of_seconds(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(UnsupportedConfigError) as caught:
        ResilientEnv.isolated(env_fn(), **kwargs)
    assert str(caught.value) == message


def test_isolation_rejects_an_env_instance_and_an_unpicklable_factory() -> None:
    with pytest.raises(
        UnsupportedConfigError, match=r"^env: an isolated env is built in a worker process: pass a picklable"
    ):
        ResilientEnv.isolated(ScriptableEnv())
    with pytest.raises(
        UnsupportedConfigError, match=r"^env: an isolated env is built .* from a picklable"
    ) as caught:
        ResilientEnv.isolated(lambda: ScriptableEnv())
    assert caught.value.__cause__ is not None


def test_a_factory_without_isolation_is_rejected_with_a_type_error_that_says_what_to_do() -> None:
    with pytest.raises(
        TypeError, match=r"^expected a gymnasium.Env \(or, with ResilientEnv.isolated, a factory of one\)"
    ):
        ResilientEnv(env_fn())


def test_the_isolate_flag_still_builds_an_isolated_env_and_warns_that_isolated_replaces_it() -> None:
    with pytest.warns(DeprecationWarning, match=r"use ResilientEnv\.isolated\(factory, \.\.\.\)") as caught:
        env = ResilientEnv(env_fn(), isolate=True, step_timeout=5.0)  # the old form
    assert caught[0].filename == __file__  # the warning points at the caller
    try:
        assert isinstance(env.unwrapped, IsolatedEnv)
        assert env.reset()[0] == TASK.prompt
    finally:
        env.close()
    assert env.unwrapped.closed
