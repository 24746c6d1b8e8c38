"""Gymnasium's env checker accepts ResilientEnv around real envs and text envs, in process and isolated,
and warns no more than it does about the same env without the wrapper."""

from __future__ import annotations

import os

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # render checks open pygame windows otherwise

import functools
import warnings
from collections.abc import Callable

import gymnasium
import pytest
from gymnasium.envs.registration import EnvSpec, find_highest_version
from gymnasium.utils.env_checker import check_env

from gym_resilience.backends.resilient import ResilientEnv
from gym_resilience.retry import RetryPolicy
from gym_resilience.testing import ScriptableEnv

NAMES = [
    "CartPole",
    "MountainCar",
    "MountainCarContinuous",
    "Pendulum",
    "Acrobot",
    "FrozenLake",
    "Taxi",
    "CliffWalking",
    "Blackjack",
]
LATEST_IDS = [f"{name}-v{find_highest_version(None, name)}" for name in NAMES]

# check_env says this of any wrapped env, naming the wrapper stack; it is about wrapping, not this wrapper.
WRAPPED_ENV_WARNING = "is different from the unwrapped version"

SCRIPTABLE_SPEC = EnvSpec(
    id="gym_resilience/Scriptable-v0", entry_point="gym_resilience.testing:ScriptableEnv"
)


def checker_warnings(make_env: Callable[[], gymnasium.Env[object, object]]) -> list[str]:
    """The warnings check_env emits for the env, except the one it emits for any wrapped env."""
    env = make_env()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_env(env)
    finally:
        env.close()
    return [str(warning.message) for warning in caught if WRAPPED_ENV_WARNING not in str(warning.message)]


def test_the_latest_versions_are_the_ones_checked() -> None:
    assert "Taxi-v4" in LATEST_IDS
    assert "CliffWalking-v1" in LATEST_IDS
    assert all(env_id in gymnasium.registry for env_id in LATEST_IDS)


@pytest.mark.parametrize("env_id", LATEST_IDS)
def test_check_env_passes_on_a_wrapped_registered_env_with_no_warning_about_the_wrapper(env_id: str) -> None:
    baseline = checker_warnings(lambda: gymnasium.make(env_id))
    wrapped = checker_warnings(lambda: ResilientEnv(gymnasium.make(env_id)))
    assert wrapped == baseline


def test_check_env_passes_on_a_wrapped_env_with_a_reset_retry_policy() -> None:
    policy = RetryPolicy(attempts=2, sleep=lambda _seconds: None)
    assert checker_warnings(lambda: ResilientEnv(gymnasium.make("CartPole-v1"), reset_retry=policy)) == (
        checker_warnings(lambda: gymnasium.make("CartPole-v1"))
    )


def test_check_env_passes_on_a_wrapped_text_env_with_no_warning_at_all() -> None:
    assert checker_warnings(lambda: ResilientEnv(gymnasium.make(SCRIPTABLE_SPEC))) == []


def test_check_env_passes_on_an_isolated_cartpole_with_the_warnings_of_the_in_process_one() -> None:
    cartpole = functools.partial(gymnasium.make, "CartPole-v1")
    assert checker_warnings(lambda: ResilientEnv.isolated(cartpole)) == (
        checker_warnings(lambda: ResilientEnv(cartpole()))
    )


def test_check_env_passes_on_a_wrapped_bare_text_env() -> None:
    # Without a spec check_env cannot re-create the env for its render checks, and says so.
    assert checker_warnings(lambda: ResilientEnv(ScriptableEnv())) == checker_warnings(ScriptableEnv)
