"""The library's old module paths still import, each name with a DeprecationWarning naming its new home."""

from __future__ import annotations

import importlib

import pytest

MOVED = [
    ("gym_resilience.env", "ResilientEnv", "gym_resilience.backends.resilient"),
    ("gym_resilience.isolation", "IsolatedEnv", "gym_resilience.backends.process"),
    ("gym_resilience.isolation", "StartAbort", "gym_resilience.backends.protocol"),
    ("gym_resilience.isolation", "RemoteEnv", "gym_resilience.backends.protocol"),
    ("gym_resilience.isolation", "checked_env", "gym_resilience.backends.protocol"),
    ("gym_resilience.ray_env", "RayEnv", "gym_resilience.backends.ray"),
    ("gym_resilience.ray_env", "check_ray_installed", "gym_resilience.backends.ray"),
    ("gym_resilience.env_backends", "EnvFactory", "gym_resilience.backends.choice"),
    ("gym_resilience.worker_env", "WorkerEnv", "gym_resilience.backends.protocol"),
    ("gym_resilience.deadlines", "check_seconds", "gym_resilience.backends.deadlines"),
    ("gym_resilience.errors", "is_transient", "gym_resilience.retry"),
    ("gym_resilience.errors", "is_transient_status", "gym_resilience.retry"),
    ("gym_resilience.errors", "TRANSIENT_ERRORS", "gym_resilience.retry"),
    ("gym_resilience.errors", "settable", "gym_resilience.cleanup"),
    ("gym_resilience.errors", "ScenarioError", "harness.errors"),
    ("gym_resilience._text", "show", "gym_resilience.errors"),
    ("gym_resilience.testing_servers", "VLLMServer", "gym_resilience.engines.vllm_server"),
    ("gym_resilience.testing_servers", "servers", "gym_resilience.engines.vllm_server"),
]


@pytest.mark.parametrize(("old", "name", "new"), MOVED)
def test_a_name_read_from_its_old_module_warns_with_its_new_path_and_is_the_same_object(
    old: str, name: str, new: str
) -> None:
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning) as warned:
        value = getattr(module, name)
    assert [str(w.message) for w in warned] == [f"{old}.{name} is {new}.{name} now"]
    assert value is getattr(importlib.import_module(new), name)


def test_from_import_of_an_old_path_warns_at_the_importing_line() -> None:
    with pytest.warns(DeprecationWarning, match=r"gym_resilience.env.ResilientEnv is ") as warned:
        from gym_resilience.env import ResilientEnv  # noqa: F401
    assert warned[0].filename == __file__


def test_a_name_that_never_existed_in_an_old_module_is_an_attribute_error() -> None:
    module = importlib.import_module("gym_resilience.isolation")
    with pytest.raises(AttributeError, match=r"module 'gym_resilience.isolation' has no attribute 'nope'"):
        module.nope  # noqa: B018


def test_the_old_make_env_warns_and_still_returns_the_wrapped_env() -> None:
    from doubles import CountingTextEnv, env_fn, tasks

    from gym_resilience import ResilientEnv, RunnerConfig
    from gym_resilience.env_backends import make_env

    with pytest.warns(DeprecationWarning, match=r"backends\.choice\.make_env\(\.\.\.\)\.env now"):
        env = make_env(lambda task: env_fn(task=task)(), tasks(1)[0], RunnerConfig())
    assert isinstance(env, ResilientEnv)
    assert isinstance(env.unwrapped, CountingTextEnv)
    env.close()


def test_the_public_scenario_error_is_the_harness_one_and_imports_without_a_warning() -> None:
    import warnings

    from harness.errors import ScenarioError

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from gym_resilience import ScenarioError as public

    assert public is ScenarioError
