"""The checks of columns and rows: the batch's size and columns, each row's shape, types and values.

Messages are the contract (``sample <i>: <column> ...`` or ``batch: <column> ...``), so they are matched
exactly.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from small_batches import batch, passes, problems, real, step_wise_batch

from gym_resilience.trajectories import (
    ROLLOUT_ERROR_STOP_REASON,
    StepWiseTrajectory,
    build_batch_output,
)

# A valid batch must not warn either, unless a test says so.
pytestmark = pytest.mark.filterwarnings("error::gym_resilience.validation.OutputValidationWarning")


# Batch-level checks.


def test_empty_batch_is_reported() -> None:
    assert problems(build_batch_output([]), num_prompts=0) == [
        "batch: response_ids has no rows; a batch needs at least one sample"
    ]


def test_empty_step_wise_batch_is_reported() -> None:
    output = build_batch_output([StepWiseTrajectory(steps=[])])
    assert output.is_last_step == []
    assert problems(output, num_prompts=1, step_wise=True) == [
        "batch: response_ids has no rows; a batch needs at least one sample"
    ]


def test_batch_size_different_from_num_prompts_is_reported() -> None:
    assert problems(batch(), num_prompts=4) == ["batch: response_ids has 3 rows but num_prompts is 4"]


def test_batch_size_is_not_compared_with_num_prompts_in_step_wise_mode() -> None:
    passes(step_wise_batch(), num_prompts=3, step_wise=True)
    passes(step_wise_batch(), num_prompts=5, step_wise=True)


@pytest.mark.parametrize(
    "column",
    [
        "prompt_token_ids",
        "response_ids",
        "rewards",
        "loss_masks",
        "stop_reasons",
        "trajectory_ids",
        "is_placeholder",
        "rollout_logprobs",
        "trajectory_generation_times",
        "env_metrics",
        "rollout_expert_indices",
    ],
)
def test_column_that_is_not_a_list_is_reported(column: str) -> None:
    output = batch()
    setattr(output, column, (1, 2, 3))
    reported = problems(output)
    assert f"batch: {column} is (1, 2, 3) (tuple), expected a list" in reported


@pytest.mark.parametrize(
    "column",
    ["prompt_token_ids", "rewards", "loss_masks", "stop_reasons", "trajectory_ids", "is_placeholder"],
)
def test_required_column_that_is_none_is_reported(column: str) -> None:
    output = batch()
    setattr(output, column, None)
    assert f"batch: {column} is None (NoneType), expected a list" in problems(output)


@pytest.mark.parametrize(
    "column",
    [
        "prompt_token_ids",
        "rewards",
        "loss_masks",
        "stop_reasons",
        "trajectory_ids",
        "is_placeholder",
        "rollout_logprobs",
        "trajectory_generation_times",
        "env_metrics",
    ],
)
def test_column_shorter_than_the_batch_is_reported(column: str) -> None:
    output = batch()
    getattr(output, column).pop()
    assert problems(output) == [f"batch: {column} has 2 rows but response_ids has 3"]


def test_is_last_step_longer_than_the_batch_is_reported() -> None:
    output = step_wise_batch()
    assert output.is_last_step is not None
    output.is_last_step.append(True)
    assert problems(output, step_wise=True) == ["batch: is_last_step has 6 rows but response_ids has 5"]


def test_extra_response_row_is_reported_against_every_other_column() -> None:
    output = batch()
    output.response_ids.append([16])
    assert problems(output, num_prompts=4) == [
        f"batch: {column} has 3 rows but response_ids has 4"
        for column in (
            "prompt_token_ids",
            "rewards",
            "loss_masks",
            "stop_reasons",
            "trajectory_ids",
            "is_placeholder",
            "rollout_logprobs",
            "trajectory_generation_times",
            "env_metrics",
        )
    ]


def test_a_token_level_reward_among_trajectory_level_ones_is_reported() -> None:
    output = batch()
    output.rewards[2] = [0.5]
    assert problems(output) == [
        "sample 2: rewards is token-level (a list) but sample 0's is trajectory-level (a number); "
        "a batch's rewards must be all trajectory-level or all token-level"
    ]


def test_a_trajectory_level_reward_among_token_level_ones_is_reported() -> None:
    output = batch(token_level=True)
    output.rewards[0] = 1.0
    assert problems(output) == [
        "sample 0: rewards is trajectory-level (a number) but sample 1's is token-level (a list); "
        "a batch's rewards must be all trajectory-level or all token-level"
    ]


def test_reward_kind_tie_is_decided_by_the_first_row() -> None:
    output = build_batch_output([real([1], reward=[1.0]), real([2], reward=1.0)])
    assert problems(output) == [
        "sample 1: rewards is trajectory-level (a number) but sample 0's is token-level (a list); "
        "a batch's rewards must be all trajectory-level or all token-level"
    ]


# Per-sample shapes.


@pytest.mark.parametrize("column", ["prompt_token_ids", "response_ids", "loss_masks", "rollout_logprobs"])
def test_row_that_is_not_a_list_is_reported(column: str) -> None:
    output = batch()
    getattr(output, column)[1] = (1,)
    assert f"sample 1: {column} is (1,) (tuple), expected a list" in problems(output)


def test_empty_prompt_is_reported() -> None:
    output = batch()
    output.prompt_token_ids[1] = []
    assert problems(output) == ["sample 1: prompt_token_ids is empty"]


def test_empty_response_is_reported() -> None:
    output = batch(logprobs=False)
    output.response_ids[2] = []
    output.loss_masks[2] = []
    assert problems(output) == ["sample 2: response_ids is empty"]


def test_response_longer_than_loss_mask_is_reported_with_sample_index() -> None:
    output = batch(logprobs=False)
    output.response_ids[1].append(99)
    assert problems(output) == ["sample 1: loss_masks has 3 entries but response_ids has 4"]


def test_loss_mask_longer_than_response_is_reported_with_sample_index() -> None:
    output = batch(logprobs=False)
    output.loss_masks[0].append(1)
    assert problems(output) == ["sample 0: loss_masks has 3 entries but response_ids has 2"]


def test_token_level_reward_of_another_length_than_the_response_is_reported() -> None:
    output = batch(token_level=True, logprobs=False)
    output.rewards[1] = [0.0, 1.0]
    assert problems(output) == ["sample 1: rewards has 2 entries but response_ids has 3"]


def test_logprobs_of_another_length_than_the_response_are_reported() -> None:
    output = batch()
    assert output.rollout_logprobs is not None
    output.rollout_logprobs[2].append(-0.7)
    assert problems(output) == ["sample 2: rollout_logprobs has 2 entries but response_ids has 1"]


def test_response_longer_than_mask_reward_and_logprobs_is_reported_for_each_column() -> None:
    output = batch(token_level=True)
    output.response_ids[0].append(99)
    assert problems(output) == [
        "sample 0: loss_masks has 2 entries but response_ids has 3",
        "sample 0: rewards has 2 entries but response_ids has 3",
        "sample 0: rollout_logprobs has 2 entries but response_ids has 3",
    ]


# Per-sample types and values.


@pytest.mark.parametrize("column", ["prompt_token_ids", "response_ids"])
@pytest.mark.parametrize(
    ("bad", "shown"),
    [
        (True, "True (bool)"),
        (1.0, "1.0 (float)"),
        ("7", "'7' (str)"),
        (None, "None (NoneType)"),
        (-1, "-1 (int)"),
    ],
)
def test_token_id_that_is_not_a_non_negative_int_is_reported(column: str, bad: Any, shown: str) -> None:
    output = batch()
    getattr(output, column)[1][0] = bad
    assert problems(output) == [f"sample 1: {column}[0] is {shown}, expected a non-negative int token id"]


def test_only_the_first_bad_token_of_a_row_is_reported() -> None:
    output = batch()
    output.response_ids[1][1:] = ["x", "y"]  # type: ignore[list-item]
    assert problems(output) == [
        "sample 1: response_ids[1] is 'x' (str), expected a non-negative int token id"
    ]


@pytest.mark.parametrize(
    ("bad", "shown"), [(2, "2 (int)"), (-1, "-1 (int)"), (True, "True (bool)"), (1.0, "1.0 (float)")]
)
def test_loss_mask_value_other_than_int_zero_or_one_is_reported(bad: Any, shown: str) -> None:
    output = batch()
    output.loss_masks[1][2] = bad
    assert problems(output) == [f"sample 1: loss_masks[2] is {shown}, expected 0 or 1 (int)"]


@pytest.mark.parametrize(
    ("bad", "shown"), [(math.nan, "nan (float)"), (math.inf, "inf (float)"), (-math.inf, "-inf (float)")]
)
def test_non_finite_trajectory_level_reward_is_reported(bad: float, shown: str) -> None:
    output = batch()
    output.rewards[0] = bad
    assert problems(output) == [f"sample 0: rewards is {shown}, expected a finite number"]


@pytest.mark.parametrize(
    ("bad", "shown"), [(True, "True (bool)"), ("1.0", "'1.0' (str)"), (None, "None (NoneType)")]
)
def test_reward_that_is_not_a_number_or_list_is_reported(bad: Any, shown: str) -> None:
    output = batch()
    output.rewards[0] = bad
    assert problems(output) == [f"sample 0: rewards is {shown}, expected a finite number or a list of them"]


@pytest.mark.parametrize(
    ("bad", "shown"),
    [(math.nan, "nan (float)"), (math.inf, "inf (float)"), (False, "False (bool)"), ("1", "'1' (str)")],
)
def test_bad_token_level_reward_entry_is_reported(bad: Any, shown: str) -> None:
    output = batch(token_level=True)
    output.rewards[1] = [0.0, bad, 1.0]
    assert problems(output) == [f"sample 1: rewards[1] is {shown}, expected a finite number"]


def test_int_too_large_for_a_float_reward_is_reported_not_raised() -> None:
    output = batch(token_level=True)
    output.rewards[2] = [10**400]
    assert problems(output) == [f"sample 2: rewards[0] is {10**400!r:.57}... (int), expected a finite number"]


@pytest.mark.parametrize(
    ("bad", "shown"),
    [
        (0.5, "0.5 (float)"),
        (math.nan, "nan (float)"),
        (-math.inf, "-inf (float)"),
        (True, "True (bool)"),
        ("x", "'x' (str)"),
    ],
)
def test_logprob_that_is_not_a_finite_number_at_most_zero_is_reported(bad: Any, shown: str) -> None:
    output = batch()
    assert output.rollout_logprobs is not None
    output.rollout_logprobs[1][2] = bad
    assert problems(output) == [f"sample 1: rollout_logprobs[2] is {shown}, expected a finite number <= 0"]


def test_zero_logprob_is_valid() -> None:
    output = batch()
    assert output.rollout_logprobs is not None
    output.rollout_logprobs[1] = [0.0, -0.0, 0]
    passes(output)


@pytest.mark.parametrize(
    ("bad", "shown"), [(None, "None (NoneType)"), (1, "1 (int)"), (b"stop", "b'stop' (bytes)")]
)
def test_stop_reason_that_is_not_a_str_is_reported(bad: Any, shown: str) -> None:
    output = batch()
    output.stop_reasons[2] = bad
    assert problems(output) == [f"sample 2: stop_reasons is {shown}, expected a str"]


@pytest.mark.parametrize(("bad", "shown"), [(0, "0 (int)"), (None, "None (NoneType)")])
def test_is_placeholder_that_is_not_a_bool_is_reported(bad: Any, shown: str) -> None:
    output = batch()
    output.is_placeholder[0] = bad
    assert problems(output) == [f"sample 0: is_placeholder is {shown}, expected a bool"]


def test_trajectory_id_of_another_type_is_reported() -> None:
    output = batch()
    output.trajectory_ids[1] = "a_1"  # type: ignore[call-overload]
    assert problems(output) == ["sample 1: trajectory_ids is 'a_1' (str), expected a TrajectoryId or None"]


def test_trajectory_id_may_be_none_outside_step_wise_mode() -> None:
    output = batch()
    output.trajectory_ids[1] = None
    passes(output)


@pytest.mark.parametrize(
    ("bad", "shown"), [(-1.0, "-1.0 (float)"), (math.nan, "nan (float)"), (None, "None (NoneType)")]
)
def test_generation_time_that_is_not_a_finite_number_at_least_zero_is_reported(bad: Any, shown: str) -> None:
    output = batch()
    assert output.trajectory_generation_times is not None
    output.trajectory_generation_times[0] = bad
    assert problems(output) == [
        f"sample 0: trajectory_generation_times is {shown}, expected a finite number >= 0"
    ]


def test_long_bad_value_is_shown_shortened() -> None:
    output = batch()
    output.stop_reasons[0] = ["stop"] * 30  # type: ignore[call-overload]
    assert problems(output) == [f"sample 0: stop_reasons is {str(['stop'] * 30)[:57]}..., expected a str"]


def test_foreign_rows_are_reported_not_raised() -> None:
    # numpy's == gives an array, which has no single truth value: the checks must not raise on it.
    output = batch()
    assert output.rollout_logprobs is not None
    output.is_placeholder[0] = True
    output.stop_reasons[0] = ROLLOUT_ERROR_STOP_REASON
    output.response_ids[0] = np.array([10, 11])  # type: ignore[call-overload]
    output.loss_masks[0] = np.array([0, 0])  # type: ignore[call-overload]
    output.rewards[0] = np.array([0.0, 0.0])  # type: ignore[call-overload]
    output.rollout_logprobs[0] = np.array([0.0, 0.0])  # type: ignore[call-overload]
    assert problems(output) == [
        "sample 0: response_ids is array([10, 11]) (ndarray), expected a list",
        "sample 0: loss_masks is array([0, 0]) (ndarray), expected a list",
        "sample 0: rollout_logprobs is array([0., 0.]) (ndarray), expected a list",
        "sample 0: rewards is array([0., 0.]) (ndarray), expected a finite number or a list of them",
        "sample 0: loss_masks of a placeholder is array([0, 0]) (ndarray), expected [0]",
        "sample 0: rewards of a placeholder is array([0., 0.]) (ndarray), expected 0.0 or [0.0]",
        "sample 0: rollout_logprobs of a placeholder is array([0., 0.]) (ndarray), expected [0.0]",
    ]
