"""BatchRunner with isolated envs: a real subprocess env that hangs forever is killed at its deadline."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

import pytest
from doubles import EnvCounts, factory, hang_on, tasks
from leaks import alive_workers, worker_processes

from gym_resilience import (
    AllRolloutsFailedError,
    BatchRunner,
    EnvTimeoutError,
    RolloutTimeoutError,
    RunnerConfig,
    Task,
)
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.errors import root_cause
from gym_resilience.testing import ScriptableEnv

pytestmark = pytest.mark.slow

DEADLINE_S = 2.0


async def test_a_hung_env_in_a_batch_of_16_is_killed_and_becomes_a_placeholder() -> None:
    config = RunnerConfig(
        skip_failed_rollouts=True, max_turns=2, isolate_envs=True, env_step_timeout_s=DEADLINE_S
    )
    async with BatchRunner(ScriptedEngine(), factory(EnvCounts(), hang_on({"t5"})), config) as runner:
        # A liveness guard, not a speed check: without the deadline this batch would never finish.
        result = await asyncio.wait_for(runner.generate(tasks(16)), timeout=DEADLINE_S + 60)
        assert [t.is_placeholder for t in result.trajectories] == [i == 5 for i in range(16)]
        failure = result.failures[0]
        assert isinstance(failure.exception, EnvTimeoutError) and failure.phase == "step"
        assert str(failure.exception) == "env step exceeded its 2 s deadline"
        # The hung env's worker was killed; the other 15 wait for the runner's next batch.
        assert len(worker_processes()) == alive_workers(runner) == 15
    assert worker_processes() == set()


def test_env_deadlines_need_isolation_at_construction() -> None:
    from gym_resilience import UnsupportedConfigError

    with pytest.raises(
        UnsupportedConfigError, match=r"^env_step_timeout_s: needs env_backend='process' or 'ray'"
    ):
        RunnerConfig(skip_failed_rollouts=True, env_step_timeout_s=DEADLINE_S)


@pytest.mark.parametrize("env_threads", [2, 16])
async def test_isolated_envs_stuck_in_every_pool_thread_are_still_killed_on_time(env_threads: int) -> None:
    """The close that kills a stuck worker takes no pool thread, so it runs with every one of them stuck;
    killed at close_timeout_s, the env is not counted as closed late, and no worker outlives the batch."""
    config = RunnerConfig(
        skip_failed_rollouts=True,
        isolate_envs=True,
        env_threads=env_threads,
        rollout_timeout_s=DEADLINE_S,
        close_timeout_s=1.0,
        max_turns=1,
    )
    async with BatchRunner(ScriptedEngine(), factory(EnvCounts(), hang_on(None)), config) as runner:
        with pytest.raises(AllRolloutsFailedError) as info:
            await asyncio.wait_for(runner.generate(tasks(env_threads)), timeout=DEADLINE_S + 60)
        assert worker_processes() == set()  # every worker was stuck, so killed
    assert not any("still being built or closed" in note for note in getattr(info.value, "__notes__", []))
    for error in info.value.exceptions:
        assert isinstance(error, RolloutTimeoutError)
        assert not any("isolate_envs=True kills" in note for note in getattr(error, "__notes__", []))
    assert worker_processes() == set()


# --- a factory that returns no env -------------------------------------------------------------------


def returns(value: Any, task: Task) -> Any:
    """An env factory that returns ``value`` (module-level: a worker process imports it by reference)."""
    return value


class ClosableNotAnEnv:
    """Something with a ``close()`` that is no env: each close is a line in ``path``, in any process."""

    def __init__(self, path: str, *, fail: bool = False) -> None:
        self.path = path
        self.fail = fail

    def __repr__(self) -> str:
        return "ClosableNotAnEnv()"

    def close(self) -> None:
        with open(self.path, "a", encoding="utf-8") as file:
            file.write("closed\n")
        if self.fail:
            raise OSError("the sandbox was gone already")


async def failure_of(returned: Any, backend: str) -> BaseException:
    """What a one-rollout batch on ``backend`` raises when its factory returns ``returned``."""
    config = RunnerConfig(max_turns=1, env_backend=backend)  # type: ignore[arg-type]
    async with BatchRunner(ScriptedEngine(), functools.partial(returns, returned), config) as runner:
        with pytest.raises(Exception) as info:
            await runner.generate(tasks(1))
    return info.value


BACKENDS = ("thread", "process")
NOTED = "closing what the env factory returned also failed: OSError: the sandbox was gone already"
NOT_ENVS = {
    "none": (None, "None, expected a gymnasium.Env"),
    "dict": ({"observation": "hi"}, "{'observation': 'hi'} (of type dict), expected a gymnasium.Env"),
    "number": (3, "3 (of type int), expected a gymnasium.Env"),
    "env-class": (
        ScriptableEnv,
        "the class gym_resilience.testing.ScriptableEnv, expected a gymnasium.Env (an instance of it)",
    ),
    "other-class": (dict, "the class dict, expected a gymnasium.Env"),
}


@pytest.mark.parametrize("case", NOT_ENVS)
async def test_a_factory_that_returns_no_env_fails_with_the_same_type_error_on_threads_and_processes(
    case: str,
) -> None:
    returned, what = NOT_ENVS[case]
    seen = {}
    for backend in BACKENDS:
        error = await failure_of(returned, backend)
        seen[backend] = (type(error), str(error), root_cause(error) is error)
    expected = (TypeError, f"env factory {__name__}.returns returned {what}", True)
    assert seen == dict.fromkeys(BACKENDS, expected)
    assert worker_processes() == set()


@pytest.mark.parametrize("close_fails", [False, True])
async def test_what_a_factory_returns_that_is_no_env_is_closed_once_on_threads_and_processes(
    tmp_path: Path, close_fails: bool
) -> None:
    seen = {}
    for backend in BACKENDS:
        closes = tmp_path / f"{backend}.closes"
        error = await failure_of(ClosableNotAnEnv(str(closes), fail=close_fails), backend)
        notes = getattr(error, "__notes__", [])
        seen[backend] = (type(error), str(error), closes.read_text(), NOTED in notes)
    message = (
        f"env factory {__name__}.returns returned ClosableNotAnEnv() (of type {__name__}.ClosableNotAnEnv), "
        "expected a gymnasium.Env"
    )
    assert seen == dict.fromkeys(BACKENDS, (TypeError, message, "closed\n", close_fails))
    assert worker_processes() == set()
