"""BatchRunner logic on the scripted engine (fast); real-vLLM versions are in test_runner_vllm.py."""

from __future__ import annotations

import asyncio
import collections
import re
import time
from typing import Any

import pytest
from doubles import CountingTextEnv, EnvCounts, Fault, factory, fail_on, tasks

from gym_resilience import (
    AllRolloutsFailedError,
    BatchRunner,
    EnvStepError,
    FailureBudgetExceededError,
    OutputValidationWarning,
    RetryPolicy,
    RolloutTimeoutError,
    RunnerConfig,
    StepWiseTrajectory,
    Trajectory,
    UnsupportedConfigError,
    validate_batch_output,
)
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.placeholders import FailedRollout, substitute_placeholders
from gym_resilience.rollout import EnvPool
from gym_resilience.tasks import Task
from gym_resilience.trajectories import TrajectoryId, build_batch_output, without_timings


async def run(config: RunnerConfig, ledger: EnvCounts, fault=None, n: int = 6, engine=None, turns: int = 3):
    faults = () if fault is None else (fault,)
    runner = BatchRunner(engine or ScriptedEngine(), factory(ledger, *faults, turns=turns), config)
    return await runner.generate(tasks(n))


def test_skip_failed_rollouts_with_batched_is_rejected_at_construction() -> None:
    with pytest.raises(UnsupportedConfigError) as info:
        RunnerConfig(skip_failed_rollouts=True, batched=True)
    assert str(info.value) == (
        "skip_failed_rollouts: cannot be combined with batched=True: the batched single-turn path has no "
        "agent loop, so the flag would silently do nothing"
    )
    assert isinstance(info.value, ValueError)


def test_skip_failed_rollouts_with_routed_experts_is_rejected_at_construction() -> None:
    with pytest.raises(UnsupportedConfigError, match="a placeholder has no routed-expert indices"):
        RunnerConfig(skip_failed_rollouts=True, return_routed_experts=True)


@pytest.mark.parametrize("option", ["max_turns", "max_tokens", "n_samples_per_prompt", "env_threads"])
def test_non_positive_counts_are_rejected_naming_the_option(option: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=f"^{option}: must be a positive integer, got 0$"):
        RunnerConfig(**{option: 0})


async def test_failed_rollouts_become_placeholders_and_successes_stay_intact() -> None:
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=3, max_tokens=12)
    baseline = await run(config, EnvCounts())
    ledger = EnvCounts()
    result = await run(config, ledger, fail_on({"t1", "t4"}))
    assert [t.is_placeholder for t in result.trajectories] == [False, True, False, False, True, False]
    for index in (0, 2, 3, 5):
        assert without_timings(result.trajectories[index]) == without_timings(baseline.trajectories[index])
    placeholder = result.trajectories[1]
    assert isinstance(placeholder, Trajectory)
    assert placeholder.response_ids == [0] and placeholder.loss_mask == [0] and placeholder.reward == 0.0
    assert placeholder.stop_reason == "rollout_error"
    assert placeholder.failure is not None and placeholder.failure.phase == "step"
    assert placeholder.failure.turn == 1 and placeholder.failure.error_type == "EnvStepError"
    validate_batch_output(result.output, num_prompts=6)
    assert ledger.open == 0 and ledger.closed_more_than_once() == 0
    assert result.metrics["rollout_errors"] == 2.0
    assert result.metrics["rollout_errors/type/EnvStepError"] == 2.0
    assert result.metrics["rollout_errors/phase/step"] == 2.0


async def test_placeholder_reward_follows_token_level_rewards_and_logprobs() -> None:
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=2, token_level_rewards=True, logprobs=True)
    result = await run(config, EnvCounts(), fail_on({"t0"}, turn=0))
    placeholder = result.trajectories[0]
    assert isinstance(placeholder, Trajectory)
    assert placeholder.reward == [0.0] and placeholder.rollout_logprobs == [0.0]
    for trajectory in result.trajectories[1:]:
        assert isinstance(trajectory, Trajectory) and isinstance(trajectory.reward, list)
        assert trajectory.rollout_logprobs is not None
        assert len(trajectory.reward) == len(trajectory.rollout_logprobs) == len(trajectory.response_ids)
    validate_batch_output(result.output, num_prompts=6)


async def test_all_rollouts_failing_raises_with_the_first_exception_as_cause() -> None:
    ledger = EnvCounts()
    config = RunnerConfig(skip_failed_rollouts=True)
    with pytest.raises(AllRolloutsFailedError) as info:
        await run(config, ledger, fail_on({f"t{i}" for i in range(6)}, turn=0), n=6)
    assert isinstance(info.value, RuntimeError)
    assert len(info.value.exceptions) == 6
    assert info.value.__cause__ is info.value.exceptions[0]
    assert isinstance(info.value.__cause__, EnvStepError)
    assert ledger.open == 0


async def test_without_the_flag_a_failure_aborts_the_step_and_cancels_its_siblings() -> None:
    ledger = EnvCounts()
    engine = ScriptedEngine(delay_s=0.05)
    before = asyncio.all_tasks()
    with pytest.raises(EnvStepError, match="turn 0"):
        await run(RunnerConfig(max_turns=3), ledger, fail_on({"t2"}, turn=0), n=8, engine=engine)
    assert asyncio.all_tasks() == before
    assert engine.cancelled > 0
    assert ledger.created == 8 and ledger.open == 0 and ledger.closed_more_than_once() == 0


async def test_the_env_is_closed_when_its_rollout_raises_in_reset() -> None:
    ledger = EnvCounts()
    result = await run(
        RunnerConfig(skip_failed_rollouts=True), ledger, fail_on({"t3"}, phase="reset", turn=0)
    )
    assert result.failures[0].phase == "reset"
    assert ledger.open == 0


async def test_a_step_wise_batch_whose_first_success_has_no_steps_does_not_crash() -> None:
    failed = FailedRollout(ValueError("x"), 0, TrajectoryId("a"), "step", 0, 0.25)
    empty = StepWiseTrajectory(steps=[], e2e_time=0.1, trajectory_id=TrajectoryId("b"))
    out = substitute_placeholders(
        [failed, empty], pad_token_id=7, token_level_rewards=False, logprobs=False, step_wise=True
    )
    placeholder = out[0]
    assert isinstance(placeholder, StepWiseTrajectory) and placeholder.is_placeholder
    assert placeholder.steps[0].reward == 0.0 and placeholder.e2e_time == 0.25


async def test_a_step_wise_run_with_an_over_long_prompt_has_no_steps_and_validates() -> None:
    config = RunnerConfig(skip_failed_rollouts=True, step_wise=True, max_turns=2, max_input_length=30)
    result = await run(config, EnvCounts(), fail_on({"t0"}, phase="reset", turn=0), n=3)
    assert all(isinstance(t, StepWiseTrajectory) and not t.steps for t in result.trajectories[1:])
    with pytest.warns(OutputValidationWarning, match="every loss mask in the batch is all zeros"):
        validate_batch_output(result.output, num_prompts=3, step_wise=True)


async def test_a_placeholder_e2e_time_is_the_failed_rollouts_measured_time() -> None:
    slow_failure = fail_on({"t0"}, turn=None, exc=ConnectionError, message="network blip", sleep_s=0.2)
    result = await run(RunnerConfig(skip_failed_rollouts=True), EnvCounts(), slow_failure, n=2)
    placeholder = result.trajectories[0]
    assert placeholder.is_placeholder and placeholder.e2e_time is not None
    assert placeholder.e2e_time >= 0.2
    assert result.output.trajectory_generation_times is not None


@pytest.mark.parametrize("exc", [KeyboardInterrupt, asyncio.CancelledError])
async def test_base_exceptions_in_a_rollout_propagate_and_every_env_is_closed(
    exc: type[BaseException],
) -> None:
    ledger = EnvCounts()
    engine = ScriptedEngine(delay_s=0.02)
    with pytest.raises(exc):
        await run(
            RunnerConfig(skip_failed_rollouts=True, max_turns=3),
            ledger,
            fail_on({"t1"}, exc=exc),
            engine=engine,
        )
    assert ledger.created >= 2 and ledger.open == 0 and ledger.closed_more_than_once() == 0


async def test_mutating_one_placeholder_changes_no_other() -> None:
    config = RunnerConfig(skip_failed_rollouts=True, token_level_rewards=True, logprobs=True)
    result = await run(config, EnvCounts(), fail_on({"t0", "t1"}, turn=0), n=3)
    first, second = result.trajectories[0], result.trajectories[1]
    assert isinstance(first, Trajectory) and isinstance(second, Trajectory)
    assert isinstance(first.reward, list) and first.rollout_logprobs is not None
    first.reward[0] = 5.0
    first.loss_mask[0] = 1
    first.rollout_logprobs[0] = -1.0
    first.response_ids.append(9)
    assert second.reward == [0.0] and second.loss_mask == [0] and second.rollout_logprobs == [0.0]
    assert second.response_ids == [0]


async def test_cancelling_the_batch_closes_every_env() -> None:
    ledger = EnvCounts()
    batch = asyncio.create_task(run(RunnerConfig(max_turns=3), ledger, engine=ScriptedEngine(delay_s=1.0)))
    await asyncio.sleep(0.1)
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    assert ledger.created == 6 and ledger.open == 0


async def test_non_stop_knobs_zero_reward_and_loss_of_truncated_rows_and_placeholders() -> None:
    config = RunnerConfig(
        skip_failed_rollouts=True,
        max_tokens=4,
        zero_reward_on_non_stop=True,
        apply_overlong_filtering=True,
    )
    result = await run(config, EnvCounts(), fail_on({"t0"}, turn=0), n=3)
    assert result.output.stop_reasons == ["rollout_error", "length", "length"]
    assert result.output.rewards == [0.0, 0.0, 0.0]
    assert all(set(mask) == {0} for mask in result.output.loss_masks)


@pytest.mark.parametrize("step_wise", [False, True])
async def test_non_stop_knobs_edit_the_trajectories_and_the_output_alike(step_wise: bool) -> None:
    config = RunnerConfig(
        skip_failed_rollouts=True,
        max_tokens=4,
        step_wise=step_wise,
        zero_reward_on_non_stop=True,
        apply_overlong_filtering=True,
    )
    result = await run(config, EnvCounts(), fail_on({"t0"}, turn=0), n=3)
    rebuilt = build_batch_output(result.trajectories)
    assert rebuilt.rewards == result.output.rewards
    assert rebuilt.loss_masks == result.output.loss_masks
    assert all(set(mask) == {0} for mask in rebuilt.loss_masks)


async def test_samples_per_prompt_give_one_trajectory_per_task_and_repetition_in_order() -> None:
    result = await run(RunnerConfig(n_samples_per_prompt=2), EnvCounts(), n=2)
    assert [str(t) for t in result.output.trajectory_ids] == ["t0_0", "t0_1", "t1_0", "t1_1"]
    validate_batch_output(result.output, num_prompts=4)


async def test_max_concurrency_bounds_rollouts_in_flight() -> None:
    in_flight = peak = 0

    async def script(prompt_ids, sampling, call_index):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        from gym_resilience.engines.scripted import echo_script

        return echo_script(prompt_ids, sampling, call_index)

    await run(
        RunnerConfig(max_concurrency=2, max_turns=1), EnvCounts(), engine=ScriptedEngine(script=script), n=6
    )
    assert peak == 2


@pytest.fixture
def pool_hops(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many calls each hop to the env pool carried, in order."""
    hops: list[int] = []
    put = EnvPool._put

    def counted(self: EnvPool, calls: list[Any]) -> None:
        hops.append(len(calls))
        put(self, calls)

    monkeypatch.setattr(EnvPool, "_put", counted)
    return hops


async def test_a_rollout_steps_its_last_turn_and_closes_its_env_in_one_pool_hop(pool_hops: list[int]) -> None:
    counts = EnvCounts()
    result = await run(RunnerConfig(max_turns=2), counts, n=3)
    # Per rollout: the build and reset, the first step, then the last step with the close behind it.
    assert sorted(pool_hops) == [1] * 6 + [2] * 3
    assert (counts.created, counts.closed, counts.open) == (3, 3, 0)
    assert all(len(t.response_ids) > 0 for t in result.trajectories)


async def test_an_env_that_ends_early_is_closed_in_a_hop_of_its_own(pool_hops: list[int]) -> None:
    counts = EnvCounts()
    await run(RunnerConfig(max_turns=5), counts, n=2, turns=2)  # the env terminates at its second step
    assert sorted(pool_hops) == [1] * 8
    assert (counts.created, counts.closed, counts.open) == (2, 2, 0)


async def test_duplicate_instance_ids_are_rejected_naming_them() -> None:
    runner = BatchRunner(ScriptedEngine(), factory(EnvCounts()), RunnerConfig())
    with pytest.raises(UnsupportedConfigError, match=r"repeated: \['t0'\]"):
        await runner.generate(tasks(2) + tasks(1))


async def test_something_that_is_not_a_task_is_a_type_error_naming_its_place_and_no_env_is_built() -> None:
    counts = EnvCounts()
    runner = BatchRunner(ScriptedEngine(), factory(counts), RunnerConfig())
    row = {"prompt": [{"role": "user", "content": "hi"}], "instance_id": "t1"}
    with pytest.raises(TypeError, match=r"^tasks\[1\] is a dict, not a gym_resilience.Task$"):
        await runner.generate([*tasks(1), row])  # type: ignore[list-item]
    assert counts.created == 0


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"prompt": "What is 1?"}, TypeError, "Task.prompt must be a list of chat messages"),
        ({"prompt": {"role": "user", "content": "hi"}}, TypeError, "Task.prompt must be a list of chat"),
        ({"prompt": ["hi"]}, TypeError, "Task.prompt must be a list of chat messages"),
        ({"instance_id": 7}, TypeError, "Task.instance_id must be a str, got int: 7"),
        ({"instance_id": None}, TypeError, "Task.instance_id must be a str, got NoneType: None"),
        ({"instance_id": ""}, ValueError, "Task.instance_id must not be empty"),
        ({"env_kwargs": None}, TypeError, "Task.env_kwargs must be a mapping, got NoneType: None"),
    ],
)
def test_a_task_with_a_field_of_the_wrong_kind_is_refused_naming_the_field(
    fields: dict[str, Any], error: type[Exception], message: str
) -> None:
    valid: dict[str, Any] = {"prompt": [{"role": "user", "content": "hi"}], "instance_id": "t0"}
    with pytest.raises(error, match=f"^{re.escape(message)}"):
        Task(**(valid | fields))


def flaky_once(instance_id: str, *, turn: int = 1, exc: type[Exception] = ConnectionError) -> Fault:
    """Fails the first attempt of one task at ``turn``, then lets every later attempt through."""
    return fail_on({instance_id}, turn=turn, attempt=0, exc=exc, message="blip")


FAST_RETRY = RetryPolicy(attempts=3, initial_delay_s=0.0, max_delay_s=0.0, jitter_s=0.0)


async def test_a_transient_failure_is_retried_with_a_fresh_env_and_equals_the_fault_free_rollout() -> None:
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=3, retry=FAST_RETRY)
    clean = await run(config, EnvCounts(), n=4)
    ledger = EnvCounts()
    result = await run(config, ledger, flaky_once("t2"), n=4)
    assert not result.failures
    assert [without_timings(t) for t in result.trajectories] == [
        without_timings(t) for t in clean.trajectories
    ]
    assert ledger.created == 5 and ledger.open == 0
    assert result.metrics["retries"] == 1.0 and result.metrics["retries/succeeded"] == 1.0


async def test_exhausted_retries_become_a_placeholder_and_count_as_exhausted() -> None:
    config = RunnerConfig(skip_failed_rollouts=True, retry=FAST_RETRY)
    result = await run(config, EnvCounts(), fail_on({"t0"}, turn=0, exc=ConnectionError), n=3)
    assert result.failures[0].attempts == 3 and result.trajectories[0].is_placeholder
    assert result.metrics["retries"] == 2.0 and result.metrics["retries/exhausted"] == 1.0


async def test_a_non_transient_failure_is_not_retried() -> None:
    ledger = EnvCounts()
    config = RunnerConfig(skip_failed_rollouts=True, retry=FAST_RETRY)
    result = await run(config, ledger, fail_on({"t0"}, turn=0, exc=ValueError), n=2)
    assert result.failures[0].attempts == 1 and ledger.created == 2 and "retries" not in result.metrics


async def test_a_generation_past_its_deadline_is_aborted_and_becomes_a_placeholder() -> None:
    from gym_resilience import current_rollout
    from gym_resilience.engines.scripted import echo_script

    # Rollout 0 by identity: env threads finish in any order, so call 0 may be another rollout's.
    async def stuck_in_rollout_0(prompt_ids, sampling, call_index):
        rollout = current_rollout()
        if rollout is not None and rollout.rollout_index == 0:
            await asyncio.sleep(3600)
        return echo_script(prompt_ids, sampling, call_index)

    engine = ScriptedEngine(script=stuck_in_rollout_0)
    config = RunnerConfig(skip_failed_rollouts=True, generation_timeout_s=0.2)
    result = await run(config, EnvCounts(), engine=engine, n=3)
    failure = result.failures[0]
    assert isinstance(failure.exception, RolloutTimeoutError) and failure.phase == "generate"
    assert str(failure.exception) == (
        f"rollout 0 failed in generate at turn 0 after {failure.exception.elapsed_s:.3f} s: "
        "the generation exceeded its 0.2 s deadline"
    )
    assert engine.cancelled == 1


async def test_a_rollout_past_its_deadline_raises_rollout_timeout_error_and_closes_its_env() -> None:
    slow_step = fail_on({"t1"}, turn=None, exc=None, sleep_s=0.3)
    ledger = EnvCounts()
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=3, rollout_timeout_s=0.15)
    result = await run(config, ledger, slow_step, n=3)
    assert isinstance(result.failures[0].exception, RolloutTimeoutError)
    assert result.failures[0].phase == "step"
    assert ledger.open == 0


async def test_more_failures_than_the_budget_raise_with_every_failure_attached() -> None:
    config = RunnerConfig(skip_failed_rollouts=True, max_failed_fraction=0.25)
    with pytest.raises(FailureBudgetExceededError) as info:
        await run(config, EnvCounts(), fail_on({"t0", "t3", "t5"}, turn=0), n=8)
    assert len(info.value.exceptions) == 3 and info.value.total == 8
    assert str(info.value) == (
        "3 of 8 rollouts failed, over the budget of 25%: ValueError: injected step failure in t0 at turn 0"
    )
    within = await run(config, EnvCounts(), fail_on({"t0", "t3"}, turn=0), n=8)
    assert len(within.failures) == 2


@pytest.mark.parametrize(
    ("option", "value", "reason"),
    [
        ("temperature", float("nan"), "expected a finite number, got .nan"),
        ("temperature", "0.7", "expected a number, got '0.7'"),
        ("top_p", None, "expected a number, got null"),
        ("seed", "0", "expected an integer or null, got '0'"),
        ("seed", 1.5, "expected an integer or null, got 1.5"),
        ("max_failed_fraction", "0.5", "expected a number or null, got '0.5'"),
        ("skip_failed_rollouts", "no", "expected true or false, got 'no'"),
        ("retry", 3, "expected None or a RetryPolicy, got 3"),
        ("close_timeout_s", float("inf"), "expected a finite number, got .inf"),
    ],
)
def test_a_field_of_the_wrong_type_is_rejected_at_construction_naming_it(
    option: str, value: Any, reason: str
) -> None:
    with pytest.raises(UnsupportedConfigError) as info:
        RunnerConfig(**{option: value})
    assert (info.value.option, info.value.reason) == (option, reason)


@pytest.mark.parametrize("seed", [-1, -3, 2**62 + 1, 2**63 - 1, 2**64])
def test_a_seed_that_would_leave_a_rollout_unseeded_or_refused_by_vllm_is_rejected(seed: int) -> None:
    """vLLM takes -1 for no seed and refuses one past 64 bits; rollout i is seeded with seed + i."""
    with pytest.raises(UnsupportedConfigError, match=r"^seed: must be None or an int from 0 to 2\*\*62"):
        RunnerConfig(seed=seed)
    assert RunnerConfig(seed=2**62).rollout_seed(1000) == 2**62 + 1000


def test_an_integer_given_for_a_number_becomes_a_float_and_numpys_numbers_become_pythons() -> None:
    import numpy

    config = RunnerConfig(temperature=1, top_p=1)
    assert type(config.temperature) is float and type(config.top_p) is float
    config = RunnerConfig(seed=numpy.int64(5), max_turns=numpy.int32(3), temperature=numpy.float32(0.5))
    assert (config.seed, config.max_turns, config.temperature) == (5, 3, 0.5)
    assert (type(config.seed), type(config.max_turns), type(config.temperature)) == (int, int, float)


def test_env_deadlines_without_isolation_are_rejected() -> None:
    with pytest.raises(
        UnsupportedConfigError, match=r"^env_step_timeout_s: needs env_backend='process' or 'ray'"
    ):
        RunnerConfig(env_step_timeout_s=1.0)


def test_a_failure_budget_without_skip_failed_rollouts_is_rejected() -> None:
    with pytest.raises(UnsupportedConfigError, match=r"^max_failed_fraction: needs skip_failed_rollouts"):
        RunnerConfig(max_failed_fraction=0.5)


async def test_engine_and_env_calls_can_tell_which_rollout_they_serve() -> None:
    from gym_resilience import current_rollout
    from gym_resilience.engines.scripted import echo_script

    seen: list[tuple[str, int, int, int | None]] = []

    def engine_side(prompt_ids, sampling, call_index):
        rollout = current_rollout()
        assert rollout is not None
        seen.append(("generate", rollout.rollout_index, rollout.attempt, rollout.turn))
        return echo_script(prompt_ids, sampling, call_index)

    def env_side(phase: str) -> None:
        rollout = current_rollout()
        assert rollout is not None
        seen.append((phase, rollout.rollout_index, rollout.attempt, rollout.turn))

    class Probed(CountingTextEnv):
        def reset(self, **kwargs: Any) -> Any:
            env_side("reset")
            return super().reset(**kwargs)

        def step(self, action: str) -> Any:
            env_side("step")
            return super().step(action)

    env_factory = factory(EnvCounts(), env=Probed)
    runner = BatchRunner(ScriptedEngine(script=engine_side), env_factory, RunnerConfig(max_turns=2))
    await runner.generate(tasks(2))
    assert sorted(seen) == sorted(
        (phase, index, 0, turn)
        for index in (0, 1)
        for phase, turn in [("reset", None), ("generate", 0), ("step", 0), ("generate", 1), ("step", 1)]
    )
    assert current_rollout() is None


@pytest.mark.parametrize(
    "make",
    [
        lambda ts: iter(ts),
        lambda ts: (task for task in ts),
        tuple,
        collections.deque,
    ],
    ids=["iterator", "generator", "tuple", "deque"],
)
async def test_generate_takes_any_iterable_of_tasks_and_reads_it_once(make: Any) -> None:
    ledger = EnvCounts()
    config = RunnerConfig(max_turns=2)
    result = await BatchRunner(ScriptedEngine(), factory(ledger), config).generate(make(tasks(3)))
    assert [str(t.trajectory_id) for t in result.trajectories] == ["t0_0", "t1_0", "t2_0"]
    assert ledger.created == 3 and ledger.open == 0
    validate_batch_output(result.output, num_prompts=3)


@pytest.mark.parametrize(
    "given", [tasks(1)[0], "t0", {"t0": 1}, 3], ids=["one task", "a string", "a mapping", "a number"]
)
async def test_generate_refuses_what_is_not_an_iterable_of_tasks_before_building_an_env(given: Any) -> None:
    ledger = EnvCounts()
    with pytest.raises(TypeError, match=r"^generate\(\) takes an iterable of gym_resilience.Task, not a "):
        await BatchRunner(ScriptedEngine(), factory(ledger), RunnerConfig()).generate(given)
    assert ledger.created == 0


async def test_an_empty_iterator_of_tasks_is_refused_as_an_empty_list_is() -> None:
    with pytest.raises(UnsupportedConfigError, match="generate\\(\\) needs at least one task"):
        await BatchRunner(ScriptedEngine(), factory(EnvCounts()), RunnerConfig()).generate(iter([]))


async def test_every_attempt_of_every_rollout_is_recorded_with_how_it_ended() -> None:
    config = RunnerConfig(
        skip_failed_rollouts=True,
        retry=RetryPolicy(attempts=2, retry_on=(ValueError,), initial_delay_s=0.0, jitter_s=0.0),
    )
    fault = Fault(instances=frozenset({"t1", "t2"}), phase="reset", attempt=0)
    always = Fault(instances=frozenset({"t2"}), phase="reset", attempt=1, error=KeyError)
    result = await BatchRunner(ScriptedEngine(), factory(EnvCounts(), fault, always), config).generate(
        tasks(3)
    )
    records = [(a.rollout_index, a.attempt, a.phase, a.node_id) for a in result.attempts]
    assert records == [
        (0, 0, "close", None),
        (1, 0, "reset", None),
        (1, 1, "close", None),
        (2, 0, "reset", None),
        (2, 1, "reset", None),
    ]
    errors = [a.error for a in result.attempts]
    assert errors[0] is None and errors[2] is None
    assert errors[1] is not None and errors[1].startswith("EnvResetError")
    assert errors[4] is not None and errors[4].startswith("EnvResetError")
    assert all(a.elapsed_s >= 0 for a in result.attempts)


async def test_a_rollout_cancelled_while_closing_its_env_still_closes_it() -> None:
    class SlowClose(CountingTextEnv):
        def close(self) -> None:
            time.sleep(0.3)
            super().close()

    interrupt_t0 = fail_on({"t0"}, turn=1, exc=KeyboardInterrupt, sleep_s=0.1)
    ledger = EnvCounts()
    env_factory = lambda task: (CountingTextEnv if task.instance_id == "t0" else SlowClose)(  # noqa: E731
        task, ledger, (interrupt_t0,), 2
    )
    # The other rollouts reach their final close while t0 still steps; the interrupt then cancels
    # them mid-close. Their envs must be closed all the same before the interrupt propagates.
    runner = BatchRunner(ScriptedEngine(), env_factory, RunnerConfig(skip_failed_rollouts=True, max_turns=2))
    with pytest.raises(KeyboardInterrupt):
        await runner.generate(tasks(6))
    assert ledger.created == 6 and ledger.open == 0 and ledger.closed_more_than_once() == 0
