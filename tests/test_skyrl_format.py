"""``BatchOutput.to_dict()`` is SkyRL's ``GeneratorOutput``, and ``rollout_metrics`` carries SkyRL's metrics.

``assert_skyrl_accepts`` states, as assertions, the rules SkyRL documents for a generator's output: the
keys of its ``GeneratorOutput`` type, the checks its trainer runs on every batch (one row per prompt
outside step-wise mode, per-row lengths, uniform reward kinds, the step-wise layout) and the placeholder
its ``skip_failed_rollouts`` substitutes for a failed rollout. Batches come from real vLLM generation.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import numpy as np
import pytest
from doubles import EnvCounts, factory, fail_on, tasks

from gym_resilience import (
    BatchOutput,
    BatchRunner,
    OutputValidationError,
    RunnerConfig,
    StepWiseTrajectory,
    Trajectory,
    TrajectoryId,
    build_batch_output,
    validate_batch_output,
)
from gym_resilience.metrics import generate_metrics, reward_metrics

# SkyRL's GeneratorOutput for text models, key by key.
SKYRL_KEYS = {
    "prompt_token_ids",
    "response_ids",
    "rewards",
    "loss_masks",
    "stop_reasons",
    "rollout_metrics",
    "rollout_logprobs",
    "trajectory_ids",
    "trajectory_generation_times",
    "trajectory_time_splits",
    "rollout_expert_indices",
    "is_last_step",
    "env_metrics",
}

# The per-row keys SkyRL's trainer requires to be as long as response_ids when they are lists.
PER_ROW_KEYS = (
    "response_ids",
    "loss_masks",
    "rewards",
    "rollout_logprobs",
    "stop_reasons",
    "trajectory_ids",
    "rollout_expert_indices",
    "is_last_step",
)


def trajectory_key(tid: Any) -> str:
    """How SkyRL's trainer names a trajectory: ``to_string()`` when the id has it, else ``str``."""
    return str(tid.to_string()) if hasattr(tid, "to_string") else str(tid)


def assert_skyrl_accepts(data: dict[str, Any], num_prompts: int, *, step_wise: bool = False) -> None:
    """SkyRL's documented rules for a generator's output, as assertions."""
    assert set(data) == SKYRL_KEYS
    responses = data["response_ids"]
    rows = len(responses)
    assert rows > 0, "a batch has outputs"
    if not step_wise:
        assert rows == num_prompts, "one row per prompt"
    assert len(data["prompt_token_ids"]) == rows
    for key in PER_ROW_KEYS:
        if isinstance(data[key], list):
            assert len(data[key]) == rows, key
    for index, (response, mask, reward) in enumerate(
        zip(responses, data["loss_masks"], data["rewards"], strict=True)
    ):
        assert len(response) == len(mask), index
        if isinstance(reward, list):
            assert len(reward) == len(response), index
        if data["rollout_logprobs"]:
            assert len(data["rollout_logprobs"][index]) == len(response), index
    kinds = {isinstance(reward, list) for reward in data["rewards"]}
    assert len(kinds) == 1, "rewards are all List[float] or all List[List[float]]"
    # The GeneratorOutput type: token ids are ints, stop reasons strings, metrics a dict.
    assert all(type(token) is int for row in [*responses, *data["prompt_token_ids"]] for token in row)
    assert all(isinstance(reason, str) for reason in data["stop_reasons"])
    assert isinstance(data["rollout_metrics"], dict)
    assert all(isinstance(metrics, dict) for metrics in data["env_metrics"])
    times = data["trajectory_generation_times"]
    assert times is None or (len(times) == rows and all(isinstance(t, float) and t >= 0 for t in times))
    splits = data["trajectory_time_splits"]
    assert splits is None or all(len(column) == rows for column in splits.values())
    # SkyRL's trainer groups rows by the instance_id of their trajectory id.
    for tid in data["trajectory_ids"] or []:
        assert isinstance(tid.instance_id, str) and isinstance(tid.repetition_id, int)
        assert tid.to_string() == f"{tid.instance_id}_{tid.repetition_id}"
    if step_wise:
        assert_skyrl_step_wise_layout(data)


def assert_skyrl_step_wise_layout(data: dict[str, Any]) -> None:
    """Step-wise rows: every step has its trajectory's id, a trajectory's steps are adjacent, and
    ``is_last_step`` is True exactly at each trajectory's last step (so the batch ends on one)."""
    last, ids = data["is_last_step"], [trajectory_key(tid) for tid in data["trajectory_ids"]]
    assert last is not None and last[-1] is True
    seen: set[str] = set()
    for index, key in enumerate(ids):
        if index == 0 or key != ids[index - 1]:
            assert key not in seen, f"trajectory {key} is not contiguous"
            seen.add(key)
        if index + 1 < len(ids):
            assert last[index] is (ids[index + 1] != key), index


def assert_skyrl_placeholder(data: dict[str, Any], row: int) -> None:
    """The row SkyRL's skip_failed_rollouts substitutes for a failed rollout."""
    assert data["stop_reasons"][row] == "rollout_error"
    assert len(data["response_ids"][row]) == 1 and len(data["prompt_token_ids"][row]) == 1
    assert data["loss_masks"][row] == [0]
    assert data["rewards"][row] in (0.0, [0.0])
    if data["rollout_logprobs"] is not None:
        assert data["rollout_logprobs"][row] == [0.0]
    assert data["env_metrics"][row] == {}


# Acceptance: a batch with placeholders on real vLLM, exported.


@pytest.mark.slow
@pytest.mark.parametrize(("token_level", "step_wise"), [(False, False), (True, False), (False, True)])
async def test_a_vllm_batch_with_placeholders_exports_a_generator_output_skyrls_rules_accept(
    vllm_engine: Any, token_level: bool, step_wise: bool
) -> None:
    config = RunnerConfig(
        skip_failed_rollouts=True,
        max_turns=3,
        max_tokens=12,
        logprobs=True,
        token_level_rewards=token_level,
        step_wise=step_wise,
    )
    runner = BatchRunner(vllm_engine, factory(EnvCounts(), fail_on({"t1", "t4"}, turn=1)), config)
    result = await runner.generate(tasks(6))
    data = result.output.to_dict()
    assert_skyrl_accepts(data, num_prompts=6, step_wise=step_wise)
    placeholder_rows = [row for row, reason in enumerate(data["stop_reasons"]) if reason == "rollout_error"]
    assert [trajectory_key(data["trajectory_ids"][row]) for row in placeholder_rows] == ["t1_0", "t4_0"]
    for row in placeholder_rows:
        assert_skyrl_placeholder(data, row)
    validate_batch_output(data, num_prompts=6, step_wise=step_wise)
    assert BatchOutput.from_dict(data) == result.output
    # SkyRL's metrics beside the project's own.
    metrics = data["rollout_metrics"]
    assert metrics["generate/min_num_tokens"] == 1.0  # a placeholder's one token counts, as in SkyRL
    ours_and_skyrls = {"rollout_errors", "reward/mean", "reward/avg_raw_reward", "generate/avg_num_tokens"}
    assert ours_and_skyrls <= set(metrics)
    assert metrics["generate/trajectory_time_completion_max"] == pytest.approx(
        max(result.output.trajectory_generation_times or [])
    )


@pytest.mark.slow
async def test_a_vllm_batch_without_failures_exports_its_time_splits_and_their_metrics(
    vllm_engine: Any,
) -> None:
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=2, max_tokens=12)
    result = await BatchRunner(vllm_engine, factory(EnvCounts()), config).generate(tasks(3))
    data = result.output.to_dict()
    assert_skyrl_accepts(data, num_prompts=3)
    assert set(data["trajectory_time_splits"]) == {"llm", "env"}
    expected = {
        f"generate/trajectory_time_{name}_{stat}"
        for name in ("completion", "llm", "env", "other")
        for stat in ("mean", "p90", "max")
    }
    assert expected <= set(data["rollout_metrics"])


# The export itself.


def rows() -> list[Trajectory]:
    return [
        Trajectory(
            prompt_ids=[1, 2],
            response_ids=[10, 11, 12],
            reward=1.0,
            loss_mask=[1, 1, 1],
            stop_reason="stop",
            e2e_time=1.0,
            time_splits={"llm": 0.75, "env": 0.125},
            trajectory_id=TrajectoryId("a", 0),
            env_metrics={"steps": 1.0},
        ),
        Trajectory(
            prompt_ids=[0],
            response_ids=[0],
            reward=0.0,
            loss_mask=[0],
            stop_reason="rollout_error",
            e2e_time=0.5,
            trajectory_id=TrajectoryId("a", 1),
            is_placeholder=True,
        ),
        Trajectory(
            prompt_ids=[3],
            response_ids=[13, 14, 15, 16, 17],
            reward=0.0,
            loss_mask=[1, 1, 0, 0, 1],
            stop_reason="length",
            e2e_time=2.0,
            time_splits={"llm": 1.5, "env": 0.25},
            trajectory_id=TrajectoryId("b", 0),
        ),
    ]


def test_to_dict_gives_exactly_skyrls_keys_with_copied_columns() -> None:
    output = build_batch_output(rows(), rollout_metrics={"rollout_errors": 1.0})
    data = output.to_dict()
    assert list(data) == [
        "prompt_token_ids",
        "response_ids",
        "rewards",
        "loss_masks",
        "stop_reasons",
        "rollout_metrics",
        "rollout_logprobs",
        "trajectory_ids",
        "trajectory_generation_times",
        "trajectory_time_splits",
        "rollout_expert_indices",
        "is_last_step",
        "env_metrics",
    ]
    assert data["stop_reasons"] == ["stop", "rollout_error", "length"]
    assert data["env_metrics"] == [{"steps": 1.0}, {}, {}]
    assert data["trajectory_time_splits"] is None  # the placeholder has no split
    assert data["rollout_logprobs"] is None and data["is_last_step"] is None
    assert data["rollout_expert_indices"] is None
    data["response_ids"][0].append(99)
    data["env_metrics"][0]["steps"] = 7.0
    data["rollout_metrics"]["rollout_errors"] = 9.0
    assert output == build_batch_output(rows(), rollout_metrics={"rollout_errors": 1.0})


def test_trajectory_ids_are_exported_none_when_a_row_has_none() -> None:
    output = build_batch_output(rows())
    output.trajectory_ids[2] = None
    assert output.to_dict()["trajectory_ids"] is None


def test_a_dict_shaped_as_skyrls_generator_makes_it_validates_and_reads_back() -> None:
    """SkyRL's generator gives no ids outside step-wise mode; placeholders stop with rollout_error."""
    data = build_batch_output(rows()).to_dict()
    data["trajectory_ids"] = None
    validate_batch_output(data, num_prompts=3)
    output = BatchOutput.from_dict(data)
    assert output.is_placeholder == [False, True, False]
    assert output.trajectory_ids == [None, None, None]


def test_from_dict_reads_skyrls_trajectory_id_objects_and_id_strings() -> None:
    class SkyRLTrajectoryID:
        def __init__(self, instance_id: str, repetition_id: int) -> None:
            self.instance_id, self.repetition_id = instance_id, repetition_id

    data = build_batch_output(rows()).to_dict()
    data["trajectory_ids"] = [SkyRLTrajectoryID("a", 0), "a_1", SkyRLTrajectoryID("b", 0)]
    assert BatchOutput.from_dict(data).trajectory_ids == [
        TrajectoryId("a", 0),
        TrajectoryId("a", 1),
        TrajectoryId("b", 0),
    ]


def test_from_dict_refuses_what_is_not_a_mapping_and_names_missing_keys() -> None:
    with pytest.raises(TypeError, match=r"^BatchOutput.from_dict expects a mapping, got list$"):
        BatchOutput.from_dict([])  # type: ignore[arg-type]
    data = build_batch_output(rows()).to_dict()
    del data["loss_masks"]
    with pytest.raises(OutputValidationError) as info:
        BatchOutput.from_dict(data)
    assert info.value.problems == ("batch: loss_masks is missing; a GeneratorOutput needs it",)


# SkyRL's metrics, computed as SkyRL computes them.


def test_generate_metrics_count_every_row_placeholders_included() -> None:
    metrics = generate_metrics(build_batch_output(rows()))
    # Response lengths 3, 1 (the placeholder), 5; rewards 1.0, 0.0, 0.0; generated tokens 3, 0, 3 in
    # turns of 3, and of 2 then 1.
    expected = {
        "generate/min_num_tokens": 1.0,
        "generate/max_num_tokens": 5.0,
        "generate/avg_num_tokens": 3.0,
        "generate/std_num_tokens": math.sqrt(8 / 3),  # population standard deviation
        "generate/avg_tokens_non_zero_rewards": 3.0,
        "generate/avg_tokens_zero_rewards": 3.0,
        "generate/avg_assistant_tokens": 2.0,
        "generate/min_assistant_tokens": 0.0,
        "generate/max_assistant_tokens": 3.0,
        "generate/std_assistant_tokens": math.sqrt(2.0),
        "generate/tokens_per_turn_mean": 2.0,
        "generate/tokens_per_turn_std": math.sqrt(2 / 3),
        "generate/tokens_per_turn_max": 3.0,
        # Completion times 1.0, 0.5, 2.0: the 90th percentile interpolates between 1.0 and 2.0.
        "generate/trajectory_time_completion_mean": 3.5 / 3,
        "generate/trajectory_time_completion_p90": 1.8,
        "generate/trajectory_time_completion_max": 2.0,
    }
    assert metrics == pytest.approx(expected)


@pytest.mark.parametrize(
    "mask",
    [
        [1, 1, 0, 1, 0, 0, 1, 1],
        [True, True, False, True, False, False, True, True],
        [1, 2, 0, 1, 0, 0, 300, 1],
        [1.0, 0.5, 0.0, 2.5, 0.0, 0.0, -1.0, 1.0],
    ],
    ids=["ints", "bools", "nonzero beyond one", "any float but zero, as SkyRL counts"],
)
def test_tokens_per_turn_count_the_runs_of_nonzero_mask_entries_of_any_row_type(mask: list[int]) -> None:
    output = build_batch_output(rows())
    output.loss_masks = [list(mask), tuple(mask), np.array(mask)]  # type: ignore[list-item]
    metrics = generate_metrics(output)
    # Each row: turns of 2, 1 and 2 tokens.
    assert metrics["generate/tokens_per_turn_mean"] == pytest.approx(5 / 3)
    assert metrics["generate/tokens_per_turn_max"] == 2.0


@pytest.mark.parametrize("seed", range(20))
def test_generate_metrics_are_numpys_to_the_bit_on_rows_of_any_length_reward_and_mask(seed: int) -> None:
    # Counts of tokens are averaged without NumPy (a sum of integers is exact): SkyRL's numbers exactly.
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(int(rng.integers(1, 300))):
        length = int(rng.integers(0, 200))
        mask = rng.choice([0, 1, 1], size=length).tolist()
        reward = [0.0, 1.0, float(rng.random()), -1.0][int(rng.integers(0, 4))]
        rows.append(
            Trajectory(
                prompt_ids=[1], response_ids=[5] * length, reward=reward, loss_mask=mask, stop_reason="stop"
            )
        )
    output = build_batch_output(rows)
    tokens = np.array([len(r) for r in output.response_ids])
    assistant = np.array([sum(m) for m in output.loss_masks])
    rewards = np.array(output.rewards, dtype=float)
    turns = np.array([len(run) for m in output.loss_masks for run in bytes(m).split(b"\0") if run])
    expected = {
        "generate/avg_num_tokens": np.mean(tokens),
        "generate/std_num_tokens": np.std(tokens),
        "generate/avg_assistant_tokens": np.mean(assistant),
        "generate/std_assistant_tokens": np.std(assistant),
        "generate/avg_tokens_non_zero_rewards": np.mean(tokens[rewards > 0]) if (rewards > 0).any() else 0.0,
        "generate/avg_tokens_zero_rewards": np.mean(tokens[rewards == 0]) if (rewards == 0).any() else 0.0,
    }
    if turns.size:
        expected["generate/tokens_per_turn_mean"] = np.mean(turns)
        expected["generate/tokens_per_turn_std"] = np.std(turns)
    metrics = generate_metrics(output)
    assert {name: metrics[name] for name in expected} == {name: float(v) for name, v in expected.items()}


def test_generate_metrics_of_time_splits_include_the_time_in_no_named_part() -> None:
    successes = [rows()[0], rows()[2]]
    metrics = generate_metrics(build_batch_output(successes))
    assert metrics["generate/trajectory_time_llm_mean"] == pytest.approx(1.125)
    assert metrics["generate/trajectory_time_env_max"] == pytest.approx(0.25)
    # other = completion - llm - env: 0.125 and 0.25.
    assert metrics["generate/trajectory_time_other_mean"] == pytest.approx(0.1875)
    assert metrics["generate/trajectory_time_other_p90"] == pytest.approx(np.percentile([0.125, 0.25], 90))


@pytest.mark.parametrize("seed", range(20))
def test_the_time_in_no_named_part_is_skyrls_to_the_bit(seed: int) -> None:
    """SkyRL's generator subtracts each part from the completion time in turn, not their sum."""
    rng = random.Random(seed)
    trajectories = [
        dataclasses.replace(
            rows()[0],
            e2e_time=rng.random() * 3,
            time_splits={"llm": rng.random(), "env": rng.random()},
        )
        for _ in range(rng.randint(1, 40))
    ]
    output = build_batch_output(trajectories)
    assert output.trajectory_time_splits is not None and output.trajectory_generation_times is not None
    other = np.array(output.trajectory_generation_times, dtype=np.float64)
    for times in output.trajectory_time_splits.values():
        other = other - np.array(times, dtype=np.float64)
    metrics = generate_metrics(output)
    assert metrics["generate/trajectory_time_other_mean"] == float(np.mean(other))
    assert metrics["generate/trajectory_time_other_max"] == float(np.max(other))


def test_step_wise_completion_times_count_each_rollout_once() -> None:
    step = rows()[0]
    output = build_batch_output(
        [
            StepWiseTrajectory(steps=[step, step], e2e_time=4.0, trajectory_id=step.trajectory_id),
            StepWiseTrajectory(steps=[rows()[2]], e2e_time=1.0, trajectory_id=TrajectoryId("b", 0)),
        ]
    )
    assert output.trajectory_generation_times == [4.0, 4.0, 1.0]
    assert generate_metrics(output)["generate/trajectory_time_completion_mean"] == pytest.approx(2.5)
    assert generate_metrics(output)["generate/avg_num_tokens"] == pytest.approx(11 / 3)  # per row


def test_reward_metrics_count_every_row_where_reward_mean_counts_successes_only() -> None:
    batch = rows()
    batch[2].reward = -0.5
    metrics = reward_metrics(build_batch_output(batch))
    assert metrics == pytest.approx({"reward/avg_raw_reward": 0.5 / 3, "reward/mean_positive_reward": 1 / 3})
    token_level = build_batch_output(
        [
            Trajectory(
                prompt_ids=[1], response_ids=[2, 3], reward=[0.5, -1.0], loss_mask=[1, 1], stop_reason="stop"
            )
        ]
    )
    assert reward_metrics(token_level) == pytest.approx(
        {"reward/avg_raw_reward": -0.5, "reward/mean_positive_reward": 0.5}
    )


def test_an_empty_batch_has_no_skyrl_metrics() -> None:
    empty = build_batch_output([])
    assert generate_metrics(empty) == {} and reward_metrics(empty) == {}


def test_counters_named_after_a_class_skyrl_would_not_sum_are_added_to_other() -> None:
    from gym_resilience.skyrl_format import SkyRLRelease, skyrl_metrics

    release = SkyRLRelease(keys=("rewards",), trajectory_id=object)
    metrics = {
        "rollout_errors": 4.0,
        "rollout_errors/cause/TerminatedError": 1.0,  # "min": SkyRL would take the minimum over batches
        "rollout_errors/cause/MaxedOutError": 1.0,  # capital M: SkyRL's test is case-sensitive, so summed
        "rollout_errors/cause/BadmeanError": 2.0,
        "rollout_errors/type/EnvStepError": 4.0,
        "generate/min_num_tokens": 3.0,
    }
    assert skyrl_metrics(metrics, release) == {
        "rollout_errors": 4.0,
        "rollout_errors/cause/other": 3.0,
        "rollout_errors/cause/MaxedOutError": 1.0,
        "rollout_errors/type/EnvStepError": 4.0,
        "generate/min_num_tokens": 3.0,
    }
