"""What envs and engines hand the runner, checked: malformed step results, numpy values, non-finite
rewards, empty generations, factories that return no env, missing logprobs, outputs the validator
rejects. Each fails its own rollout alone, and the batch still validates (scripted engine, fast)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from doubles import CountingTextEnv, EnvCounts, factory, tasks

from gym_resilience import (
    AllRolloutsFailedError,
    BatchRunner,
    RunnerConfig,
    StepWiseTrajectory,
    Trajectory,
    validate_batch_output,
)
from gym_resilience.engines import Sampling
from gym_resilience.engines.scripted import ScriptedEngine


@pytest.mark.parametrize(
    ("step_result", "message"),
    [
        ("oops", "env.step must return (observation, reward, terminated, truncated, info), got 'oops'"),
        (
            ([], "lots", False, False, {}),
            "env.step returned a reward of type str ('lots'), expected a number",
        ),
        (([], 1.0, "no", False, {}), "env.step returned terminated='no', expected a bool"),
        (([], 1.0, False, False, None), "env.step returned info of type NoneType, expected a dict"),
    ],
)
def test_a_malformed_step_result_is_a_type_error_naming_what_was_wrong(step_result, message) -> None:
    from gym_resilience.rollout.checks import checked_step

    with pytest.raises(TypeError) as info:
        checked_step(step_result)
    assert str(info.value) == message


async def test_numpys_flags_and_numbers_from_an_env_are_taken_and_flags_count_in_env_metrics() -> None:
    """Envs computed with NumPy hand back its bools and numbers; skyrl-gym counts flags as 1.0 and 0.0."""
    import numpy

    class NumpyEnv(CountingTextEnv):
        def step(self, action: str) -> Any:
            observation, reward, terminated, _truncated, info = super().step(action)
            flags = {"solved": numpy.bool_(terminated), "valid": True, "note": "text"}
            return observation, numpy.float32(reward), numpy.bool_(terminated), numpy.False_, info | flags

    ledger = EnvCounts()
    runner = BatchRunner(
        ScriptedEngine(), lambda task: NumpyEnv(task, ledger, (), 2), RunnerConfig(max_turns=2)
    )
    result = await runner.generate(tasks(2))
    assert result.failures == []
    assert [t.env_metrics for t in result.trajectories] == [{"turn": 2.0, "solved": 1.0, "valid": 1.0}] * 2
    assert ledger.open == 0


@pytest.mark.parametrize("seed", [7, None])
async def test_every_request_of_a_rollout_carries_the_sampling_its_config_names(seed: int | None) -> None:
    from gym_resilience import current_rollout
    from gym_resilience.engines.scripted import echo_script

    sent: list[tuple[int, Sampling]] = []

    def record(prompt_ids, sampling, call_index):
        rollout = current_rollout()
        assert rollout is not None
        sent.append((rollout.rollout_index, sampling))
        return echo_script(prompt_ids, sampling, call_index)

    config = RunnerConfig(max_turns=2, max_tokens=9, temperature=0.5, top_p=0.9, seed=seed, logprobs=True)
    await BatchRunner(ScriptedEngine(script=record), factory(EnvCounts()), config).generate(tasks(3))
    assert len(sent) == 6
    assert all(sampling == config.sampling(index) for index, sampling in sent)
    assert {index: sampling.seed for index, sampling in sent} == {
        i: None if seed is None else seed + i for i in range(3)
    }
    assert config.sampling(2) == Sampling(
        max_tokens=9, temperature=0.5, top_p=0.9, seed=config.rollout_seed(2), logprobs=True
    )


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), -float("inf")])
def test_a_reward_that_is_not_finite_is_a_value_error_naming_it(reward: float) -> None:
    from gym_resilience.rollout.checks import checked_step

    with pytest.raises(
        ValueError, match=f"env.step returned a reward of {reward!r}, expected a finite number"
    ):
        checked_step(([], reward, False, False, {}))


async def test_an_env_rewarding_nan_fails_its_rollout_alone_and_the_batch_validates() -> None:
    class NanReward(CountingTextEnv):
        def step(self, action: str) -> Any:
            observation, _, terminated, truncated, info = super().step(action)
            return (
                observation,
                float("nan") if self.task.instance_id == "t1" else 1.0,
                terminated,
                truncated,
                info,
            )

    ledger = EnvCounts()
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=2)
    result = await BatchRunner(ScriptedEngine(), factory(ledger, env=NanReward), config).generate(tasks(3))
    assert [t.is_placeholder for t in result.trajectories] == [False, True, False]
    assert "finite" in str(result.failures[0].exception) and ledger.open == 0
    validate_batch_output(result.output, num_prompts=3)


def _empty_at(rollout_index: int, turn: int, finish_reason: str) -> Any:
    """An engine script that returns no tokens to one rollout at one turn (an engine closed under the batch
    aborts its requests so), and echoes otherwise."""
    from gym_resilience import current_rollout
    from gym_resilience.engines.base import Generation
    from gym_resilience.engines.scripted import echo_script

    def script(prompt_ids: list[int], sampling: Sampling, call_index: int) -> Generation:
        rollout = current_rollout()
        if rollout is not None and (rollout.rollout_index, rollout.turn) == (rollout_index, turn):
            return Generation(token_ids=[], logprobs=None, finish_reason=finish_reason)  # type: ignore[arg-type]
        return echo_script(prompt_ids, sampling, call_index)

    return script


@pytest.mark.parametrize("finish_reason", ["abort", "stop"])
@pytest.mark.parametrize("token_level_rewards", [False, True])
async def test_a_first_generation_with_no_tokens_fails_its_rollout_alone(
    finish_reason: str, token_level_rewards: bool
) -> None:
    ledger = EnvCounts()
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=2, token_level_rewards=token_level_rewards)
    engine = ScriptedEngine(script=_empty_at(1, 0, finish_reason))
    result = await BatchRunner(engine, factory(ledger), config).generate(tasks(3))
    assert [t.is_placeholder for t in result.trajectories] == [False, True, False]
    no_tokens = f"the engine returned no tokens (finish reason {finish_reason!r})"
    assert str(result.failures[0].exception).endswith(f"{no_tokens}: the trajectory would have no response")
    assert ledger.open == 0
    validate_batch_output(result.output, num_prompts=3)


async def test_a_later_abort_with_no_tokens_ends_the_rollout_with_what_it_has() -> None:
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=3)
    engine = ScriptedEngine(script=_empty_at(1, 1, "abort"))
    result = await BatchRunner(engine, factory(EnvCounts()), config).generate(tasks(2))
    aborted = result.trajectories[1]
    assert isinstance(aborted, Trajectory) and not aborted.is_placeholder
    assert aborted.stop_reason == "abort" and aborted.response_ids
    validate_batch_output(result.output, num_prompts=2)


@pytest.mark.parametrize(("finish_reason", "steps"), [("stop", None), ("abort", 1)])
async def test_a_step_wise_generation_with_no_tokens_fails_unless_it_is_an_abort(
    finish_reason: str, steps: int | None
) -> None:
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=3, step_wise=True)
    engine = ScriptedEngine(script=_empty_at(1, 1, finish_reason))
    result = await BatchRunner(engine, factory(EnvCounts()), config).generate(tasks(2))
    second = result.trajectories[1]
    assert isinstance(second, StepWiseTrajectory)
    if steps is None:  # the step would have had no response
        assert second.is_placeholder
    else:  # the abort records no step: the steps before it stand
        assert not second.is_placeholder and len(second.steps) == steps
    validate_batch_output(result.output, num_prompts=2, step_wise=True)


async def test_a_factory_raising_stop_iteration_fails_its_rollout_alone() -> None:
    """A future refuses StopIteration (``next()`` on an exhausted iterator, in user code): it arrives
    wrapped in a RuntimeError, rather than breaking the hand-over of every outcome delivered with it."""
    ledger = EnvCounts()
    inner = factory(ledger)

    def env_factory(task: Any) -> Any:
        time.sleep(0.05)  # so that the builds come back together
        if task.instance_id == "t0":
            return next(iter(()))
        return inner(task)

    config = RunnerConfig(skip_failed_rollouts=True, max_turns=2)
    result = await asyncio.wait_for(BatchRunner(ScriptedEngine(), env_factory, config).generate(tasks(4)), 30)
    assert [t.is_placeholder for t in result.trajectories] == [True, False, False, False]
    error = result.failures[0].exception
    assert type(error) is RuntimeError and "an env call raised StopIteration" in str(error)
    assert ledger.created == 3 and ledger.open == 0


async def test_what_a_factory_returns_that_is_no_env_is_closed() -> None:
    closed: list[str] = []

    class NotAnEnv:
        def __init__(self, task: Any) -> None:
            self.task = task

        def close(self) -> None:
            closed.append(self.task.instance_id)

    config = RunnerConfig(skip_failed_rollouts=True)
    with pytest.raises(AllRolloutsFailedError, match=r"expected a gymnasium\.Env"):
        await BatchRunner(ScriptedEngine(), NotAnEnv, config).generate(tasks(2))
    assert sorted(closed) == ["t0", "t1"]


@pytest.mark.parametrize("step_wise", [False, True])
@pytest.mark.parametrize(("logprobs", "count"), [(None, "no logprobs"), ([-0.5], "1 logprobs")])
async def test_an_engine_without_a_logprob_per_token_fails_the_rollout_when_the_batch_records_them(
    step_wise: bool, logprobs: list[float] | None, count: str
) -> None:
    from gym_resilience import EngineError
    from gym_resilience.engines.base import Generation

    def script(prompt_ids: list[int], sampling: Sampling, call_index: int) -> Generation:
        return Generation(token_ids=[7, 8], logprobs=logprobs, finish_reason="stop")

    config = RunnerConfig(skip_failed_rollouts=True, logprobs=True, step_wise=step_wise)
    with pytest.raises(AllRolloutsFailedError) as info:
        await BatchRunner(ScriptedEngine(script=script), factory(EnvCounts()), config).generate(tasks(2))
    error = info.value.exceptions[0]
    assert isinstance(error, EngineError)
    assert str(error) == f"ScriptedEngine returned {count} for 2 tokens; logprobs=True needs one per token"


BAD_GENERATIONS = {
    "a NaN logprob": ([5, 6], [-0.1, float("nan")], "stop", "logprob nan (float) for token 1"),
    "a logprob above 0": ([5, 6], [0.5, -0.1], "stop", "logprob 0.5 (float) for token 0"),
    "an infinite logprob": ([5, 6], [-0.1, float("-inf")], "stop", "logprob -inf (float) for token 1"),
    "a negative token id": ([5, -1], [-0.1, -0.2], "stop", "token id -1 (int)"),
    "a bool token id": ([True, 6], [-0.1, -0.2], "stop", "token id True (bool)"),
    "a float token id": ([5.0, 6], [-0.1, -0.2], "stop", "token id 5.0 (float)"),
    "no finish reason": ([5, 6], [-0.1, -0.2], None, "finish reason None (NoneType)"),
}


@pytest.mark.parametrize("step_wise", [False, True])
@pytest.mark.parametrize("bad", BAD_GENERATIONS, ids=list(BAD_GENERATIONS))
async def test_an_engine_output_the_validator_rejects_fails_that_rollout_alone(
    bad: str, step_wise: bool
) -> None:
    from gym_resilience import EngineError
    from gym_resilience.engines.base import Generation

    token_ids, logprobs, finish_reason, what = BAD_GENERATIONS[bad]

    def script(prompt_ids: list[int], sampling: Sampling, call_index: int) -> Generation:
        if call_index == 1:  # one rollout's only turn
            return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason)  # type: ignore[arg-type]
        return Generation(token_ids=[7, 8], logprobs=[-0.5, -0.25], finish_reason="stop")

    ledger = EnvCounts()
    config = RunnerConfig(skip_failed_rollouts=True, logprobs=True, step_wise=step_wise, max_turns=1)
    result = await BatchRunner(ScriptedEngine(script=script), factory(ledger), config).generate(tasks(3))
    assert sum(t.is_placeholder for t in result.trajectories) == 1
    [failure] = result.failures
    assert isinstance(failure.exception, EngineError) and what in str(failure.exception)
    validate_batch_output(result.output, num_prompts=3, step_wise=step_wise)
    assert ledger.open == 0
