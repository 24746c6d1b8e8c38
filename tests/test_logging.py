"""What the runner logs: one WARNING per contained failure, naming the rollout and its root cause, one
per batch that had any, nothing printed; and an env whose close fails after a complete episode keeps
its trajectory (logged and counted, with or without ``skip_failed_rollouts``; an isolated env's in
test_skyrl_gym.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from doubles import EnvCounts, Fault, factory, fail_on, tasks

from gym_resilience import (
    BatchRunner,
    EnvStepError,
    RetryPolicy,
    RolloutFailure,
    RunnerConfig,
    validate_batch_output,
)
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.metrics import LOGGER_NAME

TESTS = Path(__file__).resolve().parent


def runner_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == LOGGER_NAME]


@pytest.mark.slow
async def test_the_warning_log_names_each_failed_rollout_and_its_root_cause(
    vllm_engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=3, max_tokens=12)
    runner = BatchRunner(vllm_engine, factory(EnvCounts(), fail_on({"t1", "t4"}, turn=1)), config)
    with caplog.at_level(logging.WARNING, logger="gym_resilience"):
        result = await runner.generate(tasks(6))
    assert [t.is_placeholder for t in result.trajectories] == [i in (1, 4) for i in range(6)]
    records = runner_records(caplog)
    assert [record.levelno for record in records] == [logging.WARNING] * 3
    assert sorted(record.getMessage() for record in records[:2]) == [
        f"rollout {i} (t{i}_0) failed in step at turn 1 with EnvStepError, root cause ValueError: "
        f"injected step failure in t{i} at turn 1; a placeholder stands in for it"
        for i in (1, 4)
    ]
    for record in records[:2]:
        failure = record.rollout_failure  # type: ignore[attr-defined]
        assert isinstance(failure, RolloutFailure)
        assert (failure.phase, failure.turn, failure.root_cause_type) == ("step", 1, "ValueError")
        assert record.trajectory_id == f"t{record.rollout_index}_0"  # type: ignore[attr-defined]
    assert records[2].getMessage() == (
        "batch: 2 of 6 rollouts failed and placeholders stand in for them (root causes: ValueError x2)"
    )


async def test_a_batch_without_failures_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=2, max_tokens=8)
    with caplog.at_level(logging.DEBUG, logger="gym_resilience"):
        await BatchRunner(ScriptedEngine(), factory(EnvCounts()), config).generate(tasks(3))
    assert runner_records(caplog) == []


async def test_a_failed_attempt_that_is_retried_is_logged_before_the_retry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reset_by_peer = "tool server reset the connection"
    once = fail_on({"t2"}, turn=None, attempt=0, exc=ConnectionError, message=reset_by_peer)
    retry = RetryPolicy(attempts=2, initial_delay_s=0.0, jitter_s=0.0, retry_on=(EnvStepError,))
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=2, max_tokens=8, retry=retry)
    with caplog.at_level(logging.WARNING, logger="gym_resilience"):
        result = await BatchRunner(ScriptedEngine(), factory(EnvCounts(), once), config).generate(tasks(3))
    assert not any(t.is_placeholder for t in result.trajectories)
    assert [record.getMessage() for record in runner_records(caplog)] == [
        "rollout 2 (t2_0) attempt 1 failed with EnvStepError, root cause ConnectionError: tool server reset "
        "the connection; retrying"
    ]


def test_in_a_program_that_configures_no_logging_the_warnings_reach_stderr_and_nothing_is_printed() -> None:
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        sys.path.insert(0, {str(TESTS)!r})
        from doubles import EnvCounts, factory, fail_on, tasks
        from gym_resilience import BatchRunner, RunnerConfig
        from gym_resilience.engines.scripted import ScriptedEngine

        config = RunnerConfig(skip_failed_rollouts=True, max_turns=2, max_tokens=8)
        runner = BatchRunner(ScriptedEngine(), factory(EnvCounts(), fail_on({{"t1"}}, turn=0)), config)
        asyncio.run(runner.generate(tasks(3)))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    # Python's last-resort handler writes the bare message of every WARNING nobody else handled.
    assert done.stderr.splitlines() == [
        "rollout 1 (t1_0) failed in step at turn 0 with EnvStepError, root cause ValueError: injected step "
        "failure in t1 at turn 0; a placeholder stands in for it",
        "batch: 1 of 3 rollouts failed and placeholders stand in for them (root causes: ValueError x1)",
    ]


# An env whose close fails after a complete episode: the trajectory is kept.


def close_fails_on(ledger: EnvCounts, instance_ids: set[str], *step_faults: Fault) -> Any:
    """Envs that close (and count it), then raise, for the tasks named in ``instance_ids``."""
    closing = fail_on(instance_ids, phase="close", turn=None, exc=OSError, message="sandbox teardown failed")
    return factory(ledger, *step_faults, closing, turns=2)


@pytest.mark.parametrize("skip_failed_rollouts", [True, False])
async def test_a_close_failure_after_a_complete_episode_keeps_the_trajectory_and_is_logged_and_counted(
    skip_failed_rollouts: bool, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = EnvCounts()
    config = RunnerConfig(skip_failed_rollouts=skip_failed_rollouts, max_turns=2, max_tokens=8)
    with caplog.at_level(logging.WARNING, logger="gym_resilience"):
        result = await BatchRunner(ScriptedEngine(), close_fails_on(ledger, {"t1"}), config).generate(
            tasks(3)
        )
    assert not any(t.is_placeholder for t in result.trajectories)
    assert [t.close_error for t in result.trajectories] == [None, "OSError: sandbox teardown failed", None]
    assert result.metrics["env_close_errors"] == 1.0 and result.metrics["rollout_errors"] == 0.0
    assert result.output.rollout_metrics["env_close_errors"] == 1.0
    validate_batch_output(result.output, num_prompts=3)
    assert [record.getMessage() for record in runner_records(caplog)] == [
        "rollout 1 (t1_0): closing its env failed after the episode was complete, so the trajectory is "
        "kept; root cause OSError: sandbox teardown failed",
        "batch: 1 envs failed to close after a complete episode (their trajectories are kept)",
    ]
    assert ledger.open == 0 and ledger.closed_more_than_once() == 0


async def test_a_close_failure_after_a_failed_rollout_still_goes_with_the_failure() -> None:
    ledger = EnvCounts()
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=2, max_tokens=8)
    factory_ = close_fails_on(ledger, {"t1"}, fail_on({"t1"}, turn=0))
    result = await BatchRunner(ScriptedEngine(), factory_, config).generate(tasks(3))
    assert result.trajectories[1].is_placeholder
    [failure] = result.failures
    assert isinstance(failure.exception.__cause__, ValueError)
    # The rollout closed the env after the step failed; the close failure is a note on that failure.
    assert failure.exception.__notes__ == ["closing the env also failed: OSError: sandbox teardown failed"]
    assert result.metrics["env_close_errors"] == 0.0
    assert ledger.open == 0
