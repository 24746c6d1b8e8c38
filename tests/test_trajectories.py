"""``build_batch_output`` lays trajectories out as the columns a trainer consumes."""

from __future__ import annotations

import pytest

from gym_resilience.errors import OutputValidationError
from gym_resilience.trajectories import (
    ROLLOUT_ERROR_STOP_REASON,
    BatchOutput,
    StepWiseTrajectory,
    Trajectory,
    TrajectoryId,
    build_batch_output,
)
from gym_resilience.validation import validate_batch_output

A, B, C = TrajectoryId("a", 0), TrajectoryId("a", 1), TrajectoryId("b", 0)


def make(
    response: list[int],
    *,
    prompt: list[int] | None = None,
    reward: float | list[float] = 1.0,
    logprobs: list[float] | None = None,
    tid: TrajectoryId | None = None,
    e2e: float | None = 1.0,
    stop: str = "stop",
    placeholder: bool = False,
    splits: dict[str, float] | None = None,
    env_metrics: dict[str, float] | None = None,
) -> Trajectory:
    return Trajectory(
        prompt_ids=prompt if prompt is not None else [7, 8],
        response_ids=response,
        reward=reward,
        loss_mask=[0] if placeholder else [1] * len(response),
        stop_reason=stop,
        rollout_logprobs=logprobs,
        trajectory_id=tid,
        e2e_time=e2e,
        is_placeholder=placeholder,
        time_splits=splits,
        env_metrics=env_metrics or {},
    )


def test_trajectory_id_prints_as_instance_and_repetition() -> None:
    assert str(TrajectoryId("task-3", 2)) == "task-3_2"
    assert TrajectoryId("task-3").repetition == 0


def test_trajectory_level_rows_are_laid_out_in_order() -> None:
    first = make([10, 11], prompt=[1], reward=0.5, tid=A, e2e=2.0, stop="length")
    second = make([12], prompt=[2, 3], reward=1.0, tid=B, e2e=3.5)
    output = build_batch_output([first, second], rollout_metrics={"rollout_error_rate": 0.0})
    assert output == BatchOutput(
        prompt_token_ids=[[1], [2, 3]],
        response_ids=[[10, 11], [12]],
        rewards=[0.5, 1.0],
        loss_masks=[[1, 1], [1]],
        stop_reasons=["length", "stop"],
        rollout_logprobs=None,
        trajectory_ids=[A, B],
        is_last_step=None,
        is_placeholder=[False, False],
        rollout_metrics={"rollout_error_rate": 0.0},
        trajectory_generation_times=[2.0, 3.5],
        trajectory_time_splits=None,
        rollout_expert_indices=None,
        env_metrics=[{}, {}],
    )
    assert len(output) == 2


def test_trajectory_id_has_the_names_of_skyrls_trajectory_id() -> None:
    tid = TrajectoryId("task-3", 2)
    assert tid.repetition_id == 2
    assert tid.to_string() == "task-3_2" == str(tid)


class SkyRLStyleId:
    """What SkyRL's TrajectoryID offers: instance_id and repetition_id."""

    def __init__(self, instance_id: str, repetition_id: int) -> None:
        self.instance_id = instance_id
        self.repetition_id = repetition_id


def test_coerce_reads_skyrl_ids_and_strings_and_leaves_anything_else_for_the_validator() -> None:
    assert TrajectoryId.coerce(A) is A
    assert TrajectoryId.coerce(SkyRLStyleId("q_7", 3)) == TrajectoryId("q_7", 3)
    assert TrajectoryId.coerce("q_7_3") == TrajectoryId("q_7", 3)
    for value in ("q", "q_", "_3", "q_\u00b2", 7, None, ("q", 3), SkyRLStyleId("q", True)):
        assert TrajectoryId.coerce(value) is value


def test_env_metrics_are_one_dict_per_row_copied() -> None:
    source = {"steps": 3.0}
    output = build_batch_output([make([10], env_metrics=source), make([11])])
    assert output.env_metrics == [{"steps": 3.0}, {}]
    assert output.env_metrics is not None
    output.env_metrics[0]["steps"] = 9.0
    assert source == {"steps": 3.0}


def test_time_splits_are_one_list_per_part_with_one_entry_per_row() -> None:
    step_split = {"llm": 1.0, "env": 2.0}
    output = build_batch_output(
        [
            make([10], splits={"llm": 0.5, "env": 0.25}),
            StepWiseTrajectory(
                steps=[make([11], splits=step_split), make([12], splits=step_split)],
                e2e_time=3.5,
            ),
        ]
    )
    assert output.trajectory_time_splits == {"llm": [0.5, 1.0, 1.0], "env": [0.25, 2.0, 2.0]}


@pytest.mark.parametrize(
    "second", [None, {"llm": 1.0}, {"llm": 1.0, "tool": 2.0}], ids=["missing", "fewer", "other"]
)
def test_time_splits_are_none_when_a_row_lacks_its_split_or_splits_differently(
    second: dict[str, float] | None,
) -> None:
    output = build_batch_output([make([10], splits={"llm": 0.5, "env": 0.25}), make([11], splits=second)])
    assert output.trajectory_time_splits is None


def test_close_error_defaults_to_none() -> None:
    assert make([10]).close_error is None
    assert StepWiseTrajectory(steps=[]).close_error is None


def test_token_level_rewards_are_laid_out_per_row() -> None:
    output = build_batch_output([make([10, 11], reward=[0.0, 1.0]), make([12], reward=[0.5])])
    assert output.rewards == [[0.0, 1.0], [0.5]]


def test_placeholder_rows_are_flagged() -> None:
    failed = make([0], prompt=[0], reward=0.0, stop=ROLLOUT_ERROR_STOP_REASON, placeholder=True, tid=B)
    output = build_batch_output([make([10], tid=A), failed, make([11], tid=C)])
    assert output.is_placeholder == [False, True, False]
    assert output.stop_reasons == ["stop", ROLLOUT_ERROR_STOP_REASON, "stop"]
    assert output.loss_masks == [[1], [0], [1]]


def test_step_wise_trajectories_give_one_row_per_step_with_is_last_step() -> None:
    first = StepWiseTrajectory(
        steps=[make([10], prompt=[1], tid=A), make([11], prompt=[1, 10, 5], tid=A), make([12], tid=A)],
        e2e_time=4.0,
        trajectory_id=A,
    )
    second = StepWiseTrajectory(steps=[make([13], tid=B)], e2e_time=1.0, trajectory_id=B)
    output = build_batch_output([first, second])
    assert output.response_ids == [[10], [11], [12], [13]]
    assert output.prompt_token_ids == [[1], [1, 10, 5], [7, 8], [7, 8]]
    assert output.is_last_step == [False, False, True, True]
    assert output.trajectory_ids == [A, A, A, B]
    # Each step carries its rollout's end-to-end time, not its own.
    assert output.trajectory_generation_times == [4.0, 4.0, 4.0, 1.0]
    validate_batch_output(output, num_prompts=2, step_wise=True)


def test_plain_trajectory_in_a_step_wise_batch_is_one_last_step() -> None:
    output = build_batch_output(
        [StepWiseTrajectory(steps=[make([10], tid=A), make([11], tid=A)], e2e_time=2.0), make([12], tid=B)]
    )
    assert output.is_last_step == [False, True, True]
    assert output.trajectory_generation_times == [2.0, 2.0, 1.0]


def test_step_wise_trajectory_without_steps_gives_no_rows() -> None:
    output = build_batch_output(
        [
            StepWiseTrajectory(steps=[], e2e_time=1.0),
            StepWiseTrajectory(steps=[make([10], tid=A)], e2e_time=1.0),
        ]
    )
    assert output.response_ids == [[10]]
    assert output.is_last_step == [True]


def test_no_trajectories_give_an_empty_trajectory_level_batch() -> None:
    output = build_batch_output([])
    assert len(output) == 0
    assert output.is_last_step is None
    assert output.rollout_logprobs is None
    assert output.trajectory_generation_times == []


def test_logprobs_column_is_none_when_no_trajectory_has_logprobs() -> None:
    output = build_batch_output([make([10]), make([11, 12])])
    assert output.rollout_logprobs is None


def test_logprobs_column_holds_each_rows_logprobs_when_present() -> None:
    output = build_batch_output([make([10], logprobs=[-0.5]), make([11, 12], logprobs=[-0.1, -0.2])])
    assert output.rollout_logprobs == [[-0.5], [-0.1, -0.2]]


def test_missing_logprobs_among_present_ones_become_an_empty_row_the_validator_rejects() -> None:
    output = build_batch_output([make([10], logprobs=[-0.5]), make([11, 12])])
    assert output.rollout_logprobs == [[-0.5], []]
    with pytest.raises(OutputValidationError) as info:
        validate_batch_output(output, num_prompts=2)
    assert info.value.problems == ("sample 1: rollout_logprobs has 0 entries but response_ids has 2",)


def test_generation_times_are_none_when_any_trajectory_lacks_an_e2e_time() -> None:
    output = build_batch_output([make([10], e2e=1.0), make([11], e2e=None), make([12], e2e=2.0)])
    assert output.trajectory_generation_times is None


def test_generation_times_are_none_when_a_step_wise_trajectory_lacks_an_e2e_time() -> None:
    output = build_batch_output(
        [StepWiseTrajectory(steps=[make([10], e2e=1.0)], e2e_time=None), make([11], e2e=1.0)]
    )
    assert output.trajectory_generation_times is None


def test_zero_generation_time_is_kept_not_treated_as_missing() -> None:
    output = build_batch_output([make([10], e2e=0.0), make([11], e2e=2)])
    assert output.trajectory_generation_times == [0.0, 2.0]
    assert all(type(seconds) is float for seconds in output.trajectory_generation_times)


def test_rollout_metrics_default_to_empty_and_are_copied() -> None:
    assert build_batch_output([make([10])]).rollout_metrics == {}
    metrics = {"rollout_errors": 1.0}
    output = build_batch_output([make([10])], rollout_metrics=metrics)
    output.rollout_metrics["rollout_errors"] = 5.0
    assert metrics == {"rollout_errors": 1.0}


def two_rows() -> list[Trajectory]:
    return [
        make([10, 11], prompt=[1], reward=[0.0, 1.0], logprobs=[-0.1, -0.2], tid=A),
        make([12], prompt=[2], reward=[0.5], logprobs=[-0.3], tid=B),
    ]


def test_mutating_the_output_leaves_the_trajectories_unchanged() -> None:
    trajectories = two_rows()
    output = build_batch_output(trajectories)
    assert output.rollout_logprobs is not None
    output.prompt_token_ids[0].append(99)
    output.response_ids[0].append(99)
    reward = output.rewards[0]
    assert isinstance(reward, list)
    reward[0] = 42.0
    output.loss_masks[0][0] = 0
    output.rollout_logprobs[0][0] = -9.0
    assert trajectories == two_rows()


def test_mutating_the_trajectories_leaves_the_output_unchanged() -> None:
    trajectories = two_rows()
    output = build_batch_output(trajectories)
    first = trajectories[0]
    first.prompt_ids.append(99)
    first.response_ids.append(99)
    assert isinstance(first.reward, list)
    first.reward[0] = 42.0
    first.loss_mask[0] = 0
    assert first.rollout_logprobs is not None
    first.rollout_logprobs[0] = -9.0
    assert output == build_batch_output(two_rows())


def test_steps_of_a_step_wise_trajectory_are_copied_too() -> None:
    step = make([10], tid=A)
    output = build_batch_output([StepWiseTrajectory(steps=[step], e2e_time=1.0)])
    output.response_ids[0].append(11)
    output.loss_masks[0].append(0)
    assert step.response_ids == [10]
    assert step.loss_mask == [1]


def test_rows_do_not_alias_each_other_even_when_trajectories_share_lists() -> None:
    shared = [10, 11]
    output = build_batch_output([make(shared), make(shared)])
    output.response_ids[0].append(12)
    assert output.response_ids[1] == [10, 11]
    assert shared == [10, 11]
