"""The one check of an option given in seconds, and the options that use it."""

from __future__ import annotations

import math

import pytest

from gym_resilience import RetryPolicy, RunnerConfig, UnsupportedConfigError
from gym_resilience.backends.deadlines import MAX_SECONDS, check_seconds
from gym_resilience.backends.process import IsolatedEnv


@pytest.mark.parametrize("value", [0.001, 1, 30.5, None])
def test_a_positive_finite_number_or_none_passes(value: float | None) -> None:
    check_seconds("step_timeout", value)


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, True, "5"])
def test_anything_else_is_rejected_naming_the_option_and_the_value(value: object) -> None:
    with pytest.raises(UnsupportedConfigError) as info:
        check_seconds("step_timeout", value)
    assert str(info.value) == f"step_timeout: must be None or a finite number of seconds > 0, got {value!r}"
    assert info.value.path == ("step_timeout",)


def test_none_is_rejected_where_a_number_is_needed() -> None:
    with pytest.raises(
        UnsupportedConfigError, match=r"^close: must be a finite number of seconds > 0, got None$"
    ):
        check_seconds("close", None, allow_none=False)


def test_zero_passes_where_allowed_and_the_message_says_so() -> None:
    check_seconds("delay", 0, allow_zero=True)
    with pytest.raises(
        UnsupportedConfigError, match=r"^delay: must be None or a finite number of seconds >= 0"
    ):
        check_seconds("delay", -0.5, allow_zero=True)


def test_the_error_carries_the_path_it_is_given() -> None:
    with pytest.raises(UnsupportedConfigError) as info:
        check_seconds("RetryPolicy.jitter_s", -1, allow_zero=True, path=("jitter_s",))
    assert info.value.option == "RetryPolicy.jitter_s" and info.value.path == ("jitter_s",)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: RunnerConfig(rollout_timeout_s=0), "rollout_timeout_s: must be None or a finite number"),
        (lambda: RetryPolicy(total_delay_s=math.inf), "RetryPolicy.total_delay_s: must be None or a finite"),
        (lambda: RetryPolicy(jitter_s=-1), "RetryPolicy.jitter_s: must be a finite number of seconds >= 0"),
        (lambda: IsolatedEnv(dict, step_timeout=-1), "step_timeout: must be None or a finite number"),
    ],
)
def test_every_seconds_option_is_checked_by_the_same_rule(build, message: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=f"^{message}"):
        build()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: RunnerConfig(isolate_envs=True, env_step_timeout_s=2.2e6),
            "env_step_timeout_s: must be at most",
        ),
        (lambda: RunnerConfig(close_timeout_s=3e6), "close_timeout_s: must be at most"),
        (lambda: IsolatedEnv(dict, close_timeout=1e9), "close_timeout: must be at most"),
    ],
)
def test_a_deadline_past_what_the_operating_system_can_wait_is_refused_naming_the_limit(
    build, message: str
) -> None:
    """A wait of the OS counts milliseconds in 32 bits: a longer deadline would fail every call at run
    time (OverflowError) rather than wait."""
    with pytest.raises(UnsupportedConfigError, match=f"^{message} 2,147,483 seconds"):
        build()
    check_seconds("step_timeout", MAX_SECONDS)


@pytest.mark.slow
def test_the_longest_deadline_allowed_is_one_an_isolated_env_can_wait() -> None:
    from functools import partial

    from gym_resilience.backends.resilient import ResilientEnv
    from gym_resilience.testing import ScriptableEnv

    with ResilientEnv.isolated(
        partial(ScriptableEnv), step_timeout=MAX_SECONDS, reset_timeout=MAX_SECONDS, close_timeout=MAX_SECONDS
    ) as env:
        env.reset()
        assert env.step("hello")[0] == "hello"
