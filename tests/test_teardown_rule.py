"""The rule for time spent closing an env, the same on every backend.

``rollout_timeout_s`` bounds the episode (build, reset, turns), ``close_timeout_s`` the close after it. A
failed rollout fails with what failed, however long its env takes to close; a finished episode is kept
whatever its close does (slow, failing, or past ``close_timeout_s``), with ``close_error`` saying why.
"""

from __future__ import annotations

import pytest
from doubles import EnvCounts, Fault, factory, fail_on, tasks
from leaks import eventually

from gym_resilience import (
    BatchRunner,
    EnvStepError,
    RetryPolicy,
    RunnerConfig,
    Trajectory,
    validate_batch_output,
)
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.errors import root_cause

BACKENDS = ["thread", "process"]


def slow_close(seconds: float) -> Fault:
    return Fault(phase="close", error=None, sleep_s=seconds)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_failed_rollout_keeps_its_root_cause_when_its_close_outlasts_the_rollout_deadline(
    backend: str,
) -> None:
    config = RunnerConfig(
        skip_failed_rollouts=True,
        env_backend=backend,
        rollout_timeout_s=1.0,
        close_timeout_s=5.0,
        max_turns=3,
    )
    faults = (fail_on({"t0"}, turn=0, exc=ConnectionError), slow_close(1.5))
    result = await BatchRunner(ScriptedEngine(), factory(EnvCounts(), *faults), config).generate(tasks(2))
    assert [t.is_placeholder for t in result.trajectories] == [True, False]
    failure = result.failures[0]
    assert isinstance(failure.exception, EnvStepError)
    assert type(root_cause(failure.exception)) is ConnectionError
    assert result.metrics["rollout_errors/cause/ConnectionError"] == 1.0
    assert "rollout_errors/type/RolloutTimeoutError" not in result.metrics


async def test_a_failure_whose_close_outlasts_the_rollout_deadline_is_retried_by_its_root_cause() -> None:
    config = RunnerConfig(
        skip_failed_rollouts=True,
        rollout_timeout_s=1.0,
        close_timeout_s=5.0,
        retry=RetryPolicy(attempts=2, retry_on=(ConnectionError,), initial_delay_s=0.01, jitter_s=0.0),
    )
    ledger = EnvCounts()
    faults = (Fault(instances=frozenset({"t0"}), turn=0, attempt=0, error=ConnectionError), slow_close(1.5))
    result = await BatchRunner(ScriptedEngine(), factory(ledger, *faults), config).generate(tasks(2))
    assert [t.is_placeholder for t in result.trajectories] == [False, False]
    assert [(a.rollout_index, a.attempt, a.error is None) for a in result.attempts] == [
        (0, 0, False),
        (0, 1, True),
        (1, 0, True),
    ]
    assert result.attempts[0].error is not None and "ConnectionError" in result.attempts[0].error
    assert ledger.open == 0 and ledger.closed_more_than_once() == 0


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_finished_episode_whose_close_outlasts_the_rollout_deadline_is_kept(backend: str) -> None:
    config = RunnerConfig(
        skip_failed_rollouts=True, env_backend=backend, rollout_timeout_s=1.0, close_timeout_s=5.0
    )
    result = await BatchRunner(ScriptedEngine(), factory(EnvCounts(), slow_close(1.5)), config).generate(
        tasks(2)
    )
    assert [t.is_placeholder for t in result.trajectories] == [False, False]
    assert all(isinstance(t, Trajectory) and t.close_error is None for t in result.trajectories)
    validate_batch_output(result.output, num_prompts=2)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_finished_episode_whose_close_outlasts_close_timeout_is_kept_with_a_close_error(
    backend: str,
) -> None:
    ledger = EnvCounts()
    config = RunnerConfig(skip_failed_rollouts=True, env_backend=backend, close_timeout_s=0.5)
    result = await BatchRunner(ScriptedEngine(), factory(ledger, slow_close(2.0)), config).generate(tasks(2))
    assert [t.is_placeholder for t in result.trajectories] == [False, False]
    for trajectory in result.trajectories:
        assert isinstance(trajectory, Trajectory)
        assert trajectory.close_error is not None and trajectory.close_error.startswith("EnvTimeoutError")
    assert result.metrics["env_close_errors"] == 2.0
    validate_batch_output(result.output, num_prompts=2)
    if backend == "thread":  # left to its thread, which closes it when the slow close returns
        assert result.metrics["envs_closed_late"] == 2.0
        assert await eventually(lambda: ledger.closed == 2)
