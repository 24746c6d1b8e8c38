"""The bundled validator: every check passes valid batches and reports invalid ones.

Messages are the contract (``sample <i>: <column> ...`` or ``batch: <column> ...``), so they are matched
exactly.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gym_resilience.errors import OutputValidationError
from gym_resilience.trajectories import (
    ROLLOUT_ERROR_STOP_REASON,
    BatchOutput,
    StepWiseTrajectory,
    Trajectory,
    TrajectoryId,
    build_batch_output,
)
from gym_resilience.validation import (
    CHECKS,
    STEP_WISE_CHECKS,
    OutputValidationWarning,
    check_batch_size,
    validate_batch_output,
)

# A valid batch must not warn either, unless a test says so.
pytestmark = pytest.mark.filterwarnings("error::gym_resilience.validation.OutputValidationWarning")

PAD = 0

# Helpers: small valid batches to break one field at a time.


def real(
    response: list[int],
    *,
    prompt: list[int] | None = None,
    reward: float | list[float] = 1.0,
    mask: list[int] | None = None,
    logprobs: list[float] | None = None,
    tid: TrajectoryId | None = None,
    stop: str = "stop",
) -> Trajectory:
    return Trajectory(
        prompt_ids=prompt if prompt is not None else [1, 2],
        response_ids=response,
        reward=reward,
        loss_mask=mask if mask is not None else [1] * len(response),
        stop_reason=stop,
        rollout_logprobs=logprobs,
        trajectory_id=tid,
        e2e_time=1.5,
    )


def placeholder(
    *, token_level: bool = False, logprobs: bool = False, tid: TrajectoryId | None = None
) -> Trajectory:
    """A placeholder as the runner makes one: one pad token, no reward, no loss."""
    return Trajectory(
        prompt_ids=[PAD],
        response_ids=[PAD],
        reward=[0.0] if token_level else 0.0,
        loss_mask=[0],
        stop_reason=ROLLOUT_ERROR_STOP_REASON,
        rollout_logprobs=[0.0] if logprobs else None,
        trajectory_id=tid,
        e2e_time=0.25,
        is_placeholder=True,
    )


def three_rows(*, token_level: bool = False, logprobs: bool = True) -> list[Trajectory]:
    rewards: list[float | list[float]] = (
        [[0.0, 1.0], [0.0, 0.0, 1.0], [0.5]] if token_level else [1.0, 0.0, 0.5]
    )
    return [
        real(
            [10, 11],
            reward=rewards[0],
            logprobs=[-0.1, -0.2] if logprobs else None,
            tid=TrajectoryId("a", 0),
        ),
        real(
            [12, 13, 14],
            prompt=[3],
            reward=rewards[1],
            mask=[0, 1, 1],
            logprobs=[-0.3, -0.4, -0.5] if logprobs else None,
            tid=TrajectoryId("a", 1),
        ),
        real(
            [15],
            prompt=[4, 5],
            reward=rewards[2],
            logprobs=[-0.6] if logprobs else None,
            tid=TrajectoryId("b", 0),
        ),
    ]


def batch(*, token_level: bool = False, logprobs: bool = True) -> BatchOutput:
    """Three valid trajectory-level (or token-level) rows, with logprobs and generation times."""
    return build_batch_output(three_rows(token_level=token_level, logprobs=logprobs))


A, B, C = TrajectoryId("a", 0), TrajectoryId("b", 0), TrajectoryId("c", 0)


def step_wise_batch() -> BatchOutput:
    """Trajectory a has 2 steps, b 1, c 2: is_last_step is [False, True, True, False, True]."""
    return build_batch_output(
        [
            StepWiseTrajectory(
                steps=[real([10], tid=A), real([11, 12], tid=A)], trajectory_id=A, e2e_time=2.0
            ),
            StepWiseTrajectory(steps=[real([13], tid=B)], trajectory_id=B, e2e_time=1.0),
            StepWiseTrajectory(steps=[real([14], tid=C), real([15], tid=C)], trajectory_id=C, e2e_time=3.0),
        ]
    )


def problems(output: BatchOutput, num_prompts: int | None = None, *, step_wise: bool = False) -> list[str]:
    """The problems the validator reports (it must raise)."""
    prompts = len(output.response_ids) if num_prompts is None else num_prompts
    with pytest.raises(OutputValidationError) as info:
        validate_batch_output(output, prompts, step_wise=step_wise)
    return list(info.value.problems)


def passes(output: BatchOutput, num_prompts: int | None = None, *, step_wise: bool = False) -> None:
    prompts = len(output.response_ids) if num_prompts is None else num_prompts
    validate_batch_output(output, prompts, step_wise=step_wise)


# Valid batches.


@pytest.mark.parametrize("token_level", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
def test_valid_batch_passes(token_level: bool, logprobs: bool) -> None:
    passes(batch(token_level=token_level, logprobs=logprobs))


def test_valid_step_wise_batch_passes() -> None:
    output = step_wise_batch()
    assert output.is_last_step == [False, True, True, False, True]
    passes(output, num_prompts=3, step_wise=True)


def test_int_rewards_are_finite_real_numbers() -> None:
    output = batch(token_level=True)
    output.rewards[0] = [0, 1]
    passes(output)


def test_optional_columns_may_be_none() -> None:
    output = batch()
    output.rollout_logprobs = None
    output.trajectory_generation_times = None
    output.is_last_step = None
    output.env_metrics = None
    output.trajectory_time_splits = None
    output.rollout_expert_indices = None
    passes(output)


def test_a_batch_built_with_the_defaults_of_batch_output_passes() -> None:
    output = BatchOutput(
        prompt_token_ids=[[1], [2], [3]],
        response_ids=[[4], [5, 6], [7]],
        rewards=[1.0, 0.0, 0.5],
        loss_masks=[[1], [1, 1], [1]],
        stop_reasons=["stop", "length", "stop"],
        rollout_logprobs=None,
        trajectory_ids=[None, None, None],
    )
    assert output.is_placeholder == []
    passes(output)


def test_empty_is_placeholder_means_no_placeholders_so_a_rollout_error_row_is_reported() -> None:
    output = batch()
    output.is_placeholder = []
    output.stop_reasons[1] = ROLLOUT_ERROR_STOP_REASON
    assert problems(output) == [
        "sample 1: stop_reasons is 'rollout_error' but is_placeholder is False (bool); "
        "only a placeholder may stop with 'rollout_error'"
    ]


def test_validating_a_batch_leaves_its_empty_is_placeholder_as_it_was() -> None:
    output = batch()
    output.is_placeholder = []
    passes(output)
    assert output.is_placeholder == []


@pytest.mark.parametrize("value", [[], (), "batch", 3, None, object()], ids=repr)
def test_anything_but_a_batch_output_or_a_mapping_is_a_type_error_naming_it(value: Any) -> None:
    with pytest.raises(TypeError) as info:
        validate_batch_output(value, 3)
    assert str(info.value) == (
        "validate_batch_output expects a BatchOutput or a mapping with the keys of SkyRL's GeneratorOutput, "
        f"got {type(value).__name__}"
    )


# SkyRL's GeneratorOutput dicts (the format's rules are in test_skyrl_format.py).


def test_a_generator_output_dict_of_a_valid_batch_passes() -> None:
    passes_dict = batch().to_dict()
    validate_batch_output(passes_dict, 3)
    validate_batch_output(step_wise_batch().to_dict(), 3, step_wise=True)


def test_a_dict_missing_required_keys_is_reported_by_those_keys_alone() -> None:
    data = batch().to_dict()
    del data["rewards"], data["stop_reasons"]
    data["loss_masks"] = None
    with pytest.raises(OutputValidationError) as info:
        validate_batch_output(data, 3)
    assert info.value.problems == (
        "batch: rewards is missing; a GeneratorOutput needs it",
        "batch: stop_reasons is missing; a GeneratorOutput needs it",
    )


def test_problems_of_a_dict_name_their_row_and_key_as_for_a_batch_output() -> None:
    data = batch().to_dict()
    data["loss_masks"][1] = [1]
    data["rewards"][2] = math.nan
    data["trajectory_ids"] = "a_0"
    with pytest.raises(OutputValidationError) as info:
        validate_batch_output(data, 3)
    assert info.value.problems == (
        "batch: trajectory_ids is 'a_0' (str), expected a list",
        "sample 1: loss_masks has 1 entries but response_ids has 3",
        "sample 2: rewards is nan (float), expected a finite number",
    )


def test_a_dict_placeholder_is_a_rollout_error_row_held_to_the_placeholder_rules() -> None:
    data = build_batch_output([*three_rows(logprobs=False), placeholder()]).to_dict()
    validate_batch_output(data, 4)
    data["loss_masks"][3] = [1]
    with pytest.raises(OutputValidationError) as info:
        validate_batch_output(data, 4)
    assert info.value.problems == ("sample 3: loss_masks of a placeholder is [1], expected [0]",)


# New columns: env_metrics rows and trajectory_time_splits.


@pytest.mark.parametrize(("bad", "shown"), [(None, "None (NoneType)"), ([1.0], "[1.0]"), ("x", "'x' (str)")])
def test_env_metrics_row_that_is_not_a_dict_is_reported(bad: Any, shown: str) -> None:
    output = batch()
    assert output.env_metrics is not None
    output.env_metrics[1] = bad
    assert problems(output) == [f"sample 1: env_metrics is {shown}, expected a dict"]


def test_time_splits_with_one_valid_time_per_row_pass() -> None:
    output = batch()
    output.trajectory_time_splits = {"llm": [0.5, 1, 0.0], "env": [0.25, 0.5, 2.0]}
    passes(output)


def test_time_splits_that_are_not_a_dict_are_reported() -> None:
    output = batch()
    output.trajectory_time_splits = [[0.5, 1.0, 0.0]]  # type: ignore[assignment]
    assert problems(output) == [
        "batch: trajectory_time_splits is [[0.5, 1.0, 0.0]], expected a dict of lists or None"
    ]


def test_each_bad_part_of_the_time_splits_is_reported() -> None:
    output = batch()
    output.trajectory_time_splits = {
        "llm": [0.5, -1.0, math.nan],
        "env": [0.25, 0.5],
        "tool": (0.1, 0.2, 0.3),  # type: ignore[dict-item]
    }
    assert problems(output) == [
        "sample 1: trajectory_time_splits['llm'] is -1.0 (float), expected a finite number >= 0",
        "sample 2: trajectory_time_splits['llm'] is nan (float), expected a finite number >= 0",
        "batch: trajectory_time_splits['env'] has 2 rows but response_ids has 3",
        "batch: trajectory_time_splits['tool'] is (0.1, 0.2, 0.3) (tuple), expected a list",
    ]


def test_every_check_returns_no_problem_for_a_valid_batch() -> None:
    for output in (batch(), batch(token_level=True, logprobs=False)):
        for check in CHECKS:
            assert check(output) == [], check.__name__
        assert check_batch_size(output, 3) == []
    for check in CHECKS + STEP_WISE_CHECKS:
        assert check(step_wise_batch()) == [], check.__name__


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


# Placeholders.


@pytest.mark.parametrize("token_level", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
@pytest.mark.parametrize("position", [0, 1, 3])
def test_placeholder_row_among_real_rows_passes(token_level: bool, logprobs: bool, position: int) -> None:
    rows = three_rows(token_level=token_level, logprobs=logprobs)
    rows.insert(position, placeholder(token_level=token_level, logprobs=logprobs, tid=TrajectoryId("p", 0)))
    output = build_batch_output(rows)
    assert output.is_placeholder[position] is True
    passes(output)


@pytest.mark.parametrize("token_level", [False, True])
def test_placeholder_row_alone_passes_but_warns_that_nothing_is_trained(token_level: bool) -> None:
    with pytest.warns(OutputValidationWarning):
        passes(build_batch_output([placeholder(token_level=token_level, logprobs=True)]))


@pytest.mark.parametrize("token_level", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
def test_placeholder_in_a_step_wise_batch_passes(token_level: bool, logprobs: bool) -> None:
    p = TrajectoryId("p", 0)
    reward: float | list[float] = [0.0, 1.0] if token_level else 1.0
    output = build_batch_output(
        [
            StepWiseTrajectory(
                steps=[
                    real([10, 11], reward=reward, logprobs=[-0.1, -0.2] if logprobs else None, tid=A),
                    real([12, 13], reward=reward, logprobs=[-0.1, -0.2] if logprobs else None, tid=A),
                ],
                trajectory_id=A,
                e2e_time=1.0,
            ),
            StepWiseTrajectory(
                steps=[placeholder(token_level=token_level, logprobs=logprobs, tid=p)],
                trajectory_id=p,
                e2e_time=0.5,
                is_placeholder=True,
            ),
        ]
    )
    assert output.is_last_step == [False, True, True]
    passes(output, num_prompts=2, step_wise=True)


def with_placeholder(*, token_level: bool = False) -> BatchOutput:
    """``batch()`` with a placeholder (with logprobs) appended as sample 3."""
    rows = three_rows(token_level=token_level)
    rows.append(placeholder(token_level=token_level, logprobs=True, tid=TrajectoryId("p", 0)))
    return build_batch_output(rows)


def test_placeholder_with_more_than_one_response_token_is_reported() -> None:
    output = with_placeholder()
    assert output.rollout_logprobs is not None
    output.response_ids[3].append(PAD)
    output.loss_masks[3].append(0)
    output.rollout_logprobs[3].append(0.0)
    assert problems(output) == [
        "sample 3: response_ids of a placeholder has 2 tokens, expected exactly 1",
        "sample 3: loss_masks of a placeholder is [0, 0], expected [0]",
        "sample 3: rollout_logprobs of a placeholder is [0.0, 0.0], expected [0.0]",
    ]


def test_placeholder_with_loss_mask_one_is_reported() -> None:
    output = with_placeholder()
    output.loss_masks[3] = [1]
    assert problems(output) == ["sample 3: loss_masks of a placeholder is [1], expected [0]"]


@pytest.mark.parametrize(
    ("token_level", "bad", "shown"),
    [(False, 0.5, "0.5 (float)"), (False, -1, "-1 (int)"), (True, [1.0], "[1.0]")],
)
def test_placeholder_with_nonzero_reward_is_reported(token_level: bool, bad: Any, shown: str) -> None:
    output = with_placeholder(token_level=token_level)
    output.rewards[3] = bad
    assert problems(output) == [f"sample 3: rewards of a placeholder is {shown}, expected 0.0 or [0.0]"]


def test_placeholder_with_int_zero_reward_passes() -> None:
    output = with_placeholder()
    output.rewards[3] = 0
    passes(output)


@pytest.mark.parametrize("reason", ["stop", "length", "abort"])
def test_placeholder_with_another_stop_reason_is_reported(reason: str) -> None:
    output = with_placeholder()
    output.stop_reasons[3] = reason
    assert problems(output) == [
        f"sample 3: stop_reasons of a placeholder is '{reason}' (str), expected 'rollout_error'"
    ]


def test_placeholder_with_nonzero_logprob_is_reported() -> None:
    output = with_placeholder()
    assert output.rollout_logprobs is not None
    output.rollout_logprobs[3] = [-0.5]
    assert problems(output) == ["sample 3: rollout_logprobs of a placeholder is [-0.5], expected [0.0]"]


def test_rollout_error_on_a_real_row_is_reported() -> None:
    output = batch()
    output.stop_reasons[1] = ROLLOUT_ERROR_STOP_REASON
    assert problems(output) == [
        "sample 1: stop_reasons is 'rollout_error' but is_placeholder is False (bool); "
        "only a placeholder may stop with 'rollout_error'"
    ]


def test_placeholder_flag_cleared_on_a_placeholder_row_is_reported() -> None:
    output = with_placeholder()
    output.is_placeholder[3] = False
    assert problems(output) == [
        "sample 3: stop_reasons is 'rollout_error' but is_placeholder is False (bool); "
        "only a placeholder may stop with 'rollout_error'"
    ]


# Step-wise checks.


def test_step_wise_batch_without_is_last_step_is_reported() -> None:
    output = step_wise_batch()
    output.is_last_step = None
    assert problems(output, step_wise=True) == ["batch: is_last_step is None; a step-wise batch needs it"]


def test_is_last_step_is_not_required_outside_step_wise_mode() -> None:
    output = step_wise_batch()
    output.is_last_step = None
    passes(output, step_wise=False)


@pytest.mark.parametrize(("bad", "shown"), [(1, "1 (int)"), (0, "0 (int)"), (None, "None (NoneType)")])
def test_is_last_step_that_is_not_a_bool_is_reported(bad: Any, shown: str) -> None:
    output = step_wise_batch()
    assert output.is_last_step is not None
    output.is_last_step[1] = bad
    assert problems(output, step_wise=True) == [f"sample 1: is_last_step is {shown}, expected a bool"]


def test_step_wise_batch_whose_last_row_is_not_last_step_is_reported() -> None:
    output = step_wise_batch()
    assert output.is_last_step is not None
    output.is_last_step[4] = False
    assert problems(output, step_wise=True) == [
        "sample 4: is_last_step is False but the last row must end its trajectory"
    ]


def test_step_wise_row_without_trajectory_id_is_reported() -> None:
    output = step_wise_batch()
    output.trajectory_ids[2] = None
    assert problems(output, step_wise=True) == [
        "sample 2: trajectory_ids is None; a step-wise batch needs a trajectory id on every row"
    ]


def test_trajectory_reappearing_after_another_is_reported() -> None:
    output = step_wise_batch()
    assert output.is_last_step is not None
    # a, a, b, a, c: is_last_step stays consistent with the id changes, only contiguity is broken.
    output.trajectory_ids[3] = A
    output.is_last_step[3] = True
    assert problems(output, step_wise=True) == [
        "sample 3: trajectory_ids a_0 reappears after another trajectory (its steps began at sample 0); "
        "a trajectory's steps must be contiguous"
    ]


def test_is_last_step_true_inside_a_trajectory_is_reported() -> None:
    output = step_wise_batch()
    assert output.is_last_step is not None
    output.is_last_step[0] = True
    assert problems(output, step_wise=True) == [
        "sample 0: is_last_step is True but sample 1 continues trajectory a_0"
    ]


def test_is_last_step_false_where_the_trajectory_changes_is_reported() -> None:
    output = step_wise_batch()
    assert output.is_last_step is not None
    output.is_last_step[2] = False
    assert problems(output, step_wise=True) == [
        "sample 2: is_last_step is False but sample 3 starts another trajectory (c_0, not b_0)"
    ]


def test_step_wise_checks_do_not_run_outside_step_wise_mode() -> None:
    output = step_wise_batch()
    assert output.is_last_step is not None
    output.is_last_step[2] = False
    output.trajectory_ids[4] = None
    passes(output, step_wise=False)


def step_wise_with_placeholder() -> BatchOutput:
    """a (2 steps), then placeholder p (1 step), then b (1 step)."""
    p = TrajectoryId("p", 0)
    return build_batch_output(
        [
            StepWiseTrajectory(steps=[real([10], tid=A), real([11], tid=A)], trajectory_id=A, e2e_time=1.0),
            StepWiseTrajectory(
                steps=[placeholder(tid=p)], trajectory_id=p, e2e_time=0.5, is_placeholder=True
            ),
            StepWiseTrajectory(steps=[real([12], tid=B)], trajectory_id=B, e2e_time=1.0),
        ]
    )


def test_step_wise_placeholder_that_is_not_last_step_is_reported() -> None:
    output = step_wise_with_placeholder()
    assert output.is_last_step is not None
    output.trajectory_ids[3] = output.trajectory_ids[2]
    output.is_last_step[2] = False
    assert problems(output, step_wise=True) == [
        "sample 2: is_last_step of a placeholder is False, expected True; "
        "a placeholder is a one-step trajectory"
    ]


def test_step_wise_placeholder_continuing_a_trajectory_is_reported() -> None:
    output = step_wise_with_placeholder()
    assert output.is_last_step is not None
    output.trajectory_ids[2] = A
    output.is_last_step[1] = False
    assert problems(output, step_wise=True) == [
        "sample 2: trajectory_ids of a placeholder continues trajectory a_0 from sample 1; "
        "a placeholder is a one-step trajectory"
    ]


# The all-zero loss mask warning.


def test_all_zero_loss_masks_warn_but_pass() -> None:
    output = batch()
    output.loss_masks[:] = [[0] * len(mask) for mask in output.loss_masks]
    with pytest.warns(
        OutputValidationWarning,
        match=re.escape(
            "every loss mask in the batch is all zeros: no token will be trained on and the loss may be NaN"
        ),
    ):
        passes(output)


def test_a_single_trained_token_does_not_warn() -> None:
    output = batch()
    output.loss_masks[:] = [[0] * len(mask) for mask in output.loss_masks]
    output.loss_masks[1][2] = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        passes(output)


def test_invalid_batch_with_all_zero_loss_masks_raises_without_warning() -> None:
    output = batch()
    output.loss_masks[:] = [[0] * len(mask) for mask in output.loss_masks]
    output.stop_reasons[0] = None  # type: ignore[call-overload]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert problems(output) == ["sample 0: stop_reasons is None (NoneType), expected a str"]


def test_output_validation_warning_is_a_user_warning() -> None:
    assert issubclass(OutputValidationWarning, UserWarning)


# All problems at once.


def test_several_problems_are_all_reported_at_once() -> None:
    output = batch(token_level=True)
    assert output.rollout_logprobs is not None
    output.response_ids[0].append(99)
    output.loss_masks[1][0] = 2
    output.rewards[2] = 0.5
    output.rollout_logprobs[1][0] = 0.1
    output.stop_reasons[2] = ROLLOUT_ERROR_STOP_REASON
    output.prompt_token_ids[1] = []
    assert problems(output, num_prompts=5) == [
        "sample 1: prompt_token_ids is empty",
        "sample 0: loss_masks has 2 entries but response_ids has 3",
        "sample 0: rewards has 2 entries but response_ids has 3",
        "sample 0: rollout_logprobs has 2 entries but response_ids has 3",
        "sample 2: rewards is trajectory-level (a number) but sample 0's is token-level (a list); "
        "a batch's rewards must be all trajectory-level or all token-level",
        "sample 1: loss_masks[0] is 2 (int), expected 0 or 1 (int)",
        "sample 1: rollout_logprobs[0] is 0.1 (float), expected a finite number <= 0",
        "sample 2: stop_reasons is 'rollout_error' but is_placeholder is False (bool); "
        "only a placeholder may stop with 'rollout_error'",
        "batch: response_ids has 3 rows but num_prompts is 5",
    ]


def test_error_message_lists_every_problem() -> None:
    output = batch()
    output.response_ids[0] = []
    output.stop_reasons[1] = 3  # type: ignore[call-overload]
    with pytest.raises(OutputValidationError) as info:
        validate_batch_output(output, 3)
    assert str(info.value) == (
        "batch output is invalid (4 problems):\n"
        "  - sample 0: response_ids is empty\n"
        "  - sample 0: loss_masks has 2 entries but response_ids has 0\n"
        "  - sample 0: rollout_logprobs has 2 entries but response_ids has 0\n"
        "  - sample 1: stop_reasons is 3 (int), expected a str"
    )


def test_output_validation_error_is_a_value_error() -> None:
    output = batch()
    output.response_ids[0] = []
    with pytest.raises(ValueError):
        validate_batch_output(output, 3)


def test_validation_still_raises_under_python_optimize() -> None:
    code = (
        "from gym_resilience.trajectories import Trajectory, build_batch_output\n"
        "from gym_resilience.validation import validate_batch_output\n"
        "from gym_resilience.errors import OutputValidationError\n"
        "row = Trajectory(prompt_ids=[1], response_ids=[], reward=1.0, loss_mask=[], stop_reason='stop')\n"
        "try:\n"
        "    validate_batch_output(build_batch_output([row]), 1)\n"
        "except OutputValidationError as error:\n"
        "    print(error.problems)\n"
    )
    result = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "('sample 0: response_ids is empty',)"


def test_ten_thousand_rows_validate_well_under_a_second() -> None:
    rows = [
        real(
            list(range(i % 50, i % 50 + 40)),
            prompt=list(range(60)),
            reward=[0.1] * 40,
            mask=[i % 2] * 40,
            logprobs=[-0.5] * 40,
            tid=TrajectoryId(str(i)),
        )
        for i in range(10_000)
    ]
    output = build_batch_output(rows)
    start = time.process_time()
    validate_batch_output(output, 10_000)
    # Typically ~0.15 s of CPU; the bound leaves room for a loaded machine.
    assert time.process_time() - start < 1.0


# Property tests: random valid batches pass; one corrupted field is always reported, naming its row.


@dataclass
class Shape:
    token_level: bool
    logprobs: bool
    step_wise: bool


@st.composite
def trajectories(draw: st.DrawFn, shape: Shape, tid: TrajectoryId) -> Trajectory:
    """A valid real (non-placeholder) trajectory."""
    length = draw(st.integers(1, 6))
    finite = st.floats(-10, 10, allow_nan=False) | st.integers(-3, 3)
    return Trajectory(
        prompt_ids=draw(st.lists(st.integers(0, 2**31), min_size=1, max_size=6)),
        response_ids=draw(st.lists(st.integers(0, 2**31), min_size=length, max_size=length)),
        reward=draw(st.lists(finite, min_size=length, max_size=length))
        if shape.token_level
        else draw(finite),
        loss_mask=draw(st.lists(st.sampled_from([0, 1]), min_size=length, max_size=length)),
        stop_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        rollout_logprobs=(
            draw(st.lists(st.floats(-30, 0), min_size=length, max_size=length)) if shape.logprobs else None
        ),
        trajectory_id=tid,
        e2e_time=draw(st.none() | st.floats(0, 100)),
    )


@st.composite
def valid_batches(draw: st.DrawFn) -> tuple[list[Trajectory | StepWiseTrajectory], Shape]:
    shape = Shape(
        token_level=draw(st.booleans()), logprobs=draw(st.booleans()), step_wise=draw(st.booleans())
    )
    count = draw(st.integers(1, 6))
    is_placeholder = draw(st.lists(st.booleans(), min_size=count, max_size=count))
    result: list[Trajectory | StepWiseTrajectory] = []
    for index, failed in enumerate(is_placeholder):
        tid = TrajectoryId(f"task{index // 2}", index % 2)
        if failed:
            steps = [placeholder(token_level=shape.token_level, logprobs=shape.logprobs, tid=tid)]
        else:
            steps = [
                draw(trajectories(shape, tid))
                for _ in range(draw(st.integers(1, 3) if shape.step_wise else st.just(1)))
            ]
        if shape.step_wise:
            result.append(
                StepWiseTrajectory(
                    steps=steps, trajectory_id=tid, e2e_time=steps[0].e2e_time, is_placeholder=failed
                )
            )
            if draw(st.booleans()):
                result.append(StepWiseTrajectory(steps=[]))  # a rollout without steps adds no row
        else:
            result.extend(steps)
    return result, shape


def _validate_expecting_warning_iff_all_masks_zero(
    output: BatchOutput, num_prompts: int, step_wise: bool
) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate_batch_output(output, num_prompts, step_wise=step_wise)
    warned = [w for w in caught if issubclass(w.category, OutputValidationWarning)]
    all_zero = not any(value for mask in output.loss_masks for value in mask)
    assert len(warned) == (1 if all_zero else 0)


@settings(max_examples=200, deadline=None)
@given(valid_batches())
def test_random_valid_batches_pass(drawn: tuple[list[Trajectory | StepWiseTrajectory], Shape]) -> None:
    items, shape = drawn
    output = build_batch_output(items)
    assert (output.is_last_step is not None) == shape.step_wise
    assert (output.rollout_logprobs is not None) == shape.logprobs
    _validate_expecting_warning_iff_all_masks_zero(output, len(items), shape.step_wise)


@settings(max_examples=100, deadline=None)
@given(valid_batches())
def test_random_valid_batches_pass_as_generator_output_dicts_and_come_back_unchanged(
    drawn: tuple[list[Trajectory | StepWiseTrajectory], Shape],
) -> None:
    items, shape = drawn
    output = build_batch_output(items)
    data = output.to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OutputValidationWarning)  # all-zero masks: the test above checks it
        validate_batch_output(data, len(items), step_wise=shape.step_wise)
    assert BatchOutput.from_dict(data) == output


Corruption = Callable[[BatchOutput, int, st.DataObject], bool]
"""Breaks one field of one row in place; returns False when it does not apply to that row."""


def draw_any(data: st.DataObject, values: list[Any]) -> Any:
    """One of ``values``, typed Any: corruptions put values of the wrong type on purpose."""
    return data.draw(st.sampled_from(values))


def _pick(data: st.DataObject, row: list[Any]) -> int:
    return data.draw(st.integers(0, len(row) - 1))


def empty_response(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    output.response_ids[i] = []
    return True


def extra_response_token(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    output.response_ids[i].append(data.draw(st.integers(0, 100)))
    return True


def bad_token_id(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    column = draw_any(data, [output.response_ids, output.prompt_token_ids])
    column[i][_pick(data, column[i])] = draw_any(data, [True, False, -1, 1.0, "7", None])
    return True


def empty_prompt(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    output.prompt_token_ids[i] = []
    return True


def bad_mask_value(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    mask = output.loss_masks[i]
    mask[_pick(data, mask)] = draw_any(data, [2, -1, True, False, 1.0, 0.0, None])
    return True


def extra_mask_entry(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    output.loss_masks[i].append(draw_any(data, [0, 1]))
    return True


def bad_reward_value(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    bad = draw_any(data, [math.nan, math.inf, -math.inf, True, False, "1", None])
    reward = output.rewards[i]
    if isinstance(reward, list):
        reward[_pick(data, reward)] = bad
    else:
        output.rewards[i] = bad
    return True


def switched_reward_kind(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    if len(output) < 2:
        return False  # one row is uniform whatever its kind
    reward = output.rewards[i]
    output.rewards[i] = reward[0] if isinstance(reward, list) else [reward] * len(output.response_ids[i])
    return True


def token_reward_of_wrong_length(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    reward = output.rewards[i]
    if not isinstance(reward, list):
        return False
    if data.draw(st.booleans()):
        reward.append(0.0)
    else:
        reward.pop()
    return True


def bad_logprob(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    if output.rollout_logprobs is None:
        return False
    row = output.rollout_logprobs[i]
    row[_pick(data, row)] = draw_any(data, [0.5, 1e-9, math.nan, -math.inf, math.inf, True, "x", None])
    return True


def logprobs_of_wrong_length(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    if output.rollout_logprobs is None:
        return False
    row = output.rollout_logprobs[i]
    if data.draw(st.booleans()):
        row.append(-0.5)
    else:
        row.pop()
    return True


def bad_stop_reason(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    if output.is_placeholder[i]:
        bad = draw_any(data, ["stop", "length", "abort", None, 1])
    else:
        bad = draw_any(data, [ROLLOUT_ERROR_STOP_REASON, None, 1, b"stop"])
    output.stop_reasons[i] = bad
    return True


def bad_placeholder_flag(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    flag = output.is_placeholder[i]
    output.is_placeholder[i] = draw_any(data, [not flag, int(flag), None])
    return True


def bad_trajectory_id(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    choices: list[Any] = ["task0_0", 7, ("task0", 0)]
    if output.is_last_step is not None:
        choices.append(None)
    output.trajectory_ids[i] = data.draw(st.sampled_from(choices))
    return True


def reassigned_trajectory_id(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    if output.is_last_step is None:
        return False  # outside step-wise mode ids are labels only
    others = sorted({tid for tid in output.trajectory_ids if tid != output.trajectory_ids[i]}, key=str)
    if not others:
        return False
    output.trajectory_ids[i] = data.draw(st.sampled_from(others))
    return True


def bad_last_step_flag(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    if output.is_last_step is None:
        return False
    flag = output.is_last_step[i]
    output.is_last_step[i] = draw_any(data, [not flag, int(flag), None])
    return True


def bad_generation_time(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    if output.trajectory_generation_times is None:
        return False
    output.trajectory_generation_times[i] = draw_any(data, [-0.1, math.nan, math.inf, "1.0", None])
    return True


def bad_env_metrics_row(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    if output.env_metrics is None:
        return False
    output.env_metrics[i] = draw_any(data, [None, [], "steps", 1.0])
    return True


def placeholder_with_real_values(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    if not output.is_placeholder[i]:
        return False
    reward = output.rewards[i]
    which = draw_any(data, ["reward", "mask", "logprob"])
    if which == "reward":
        output.rewards[i] = [1.0] if isinstance(reward, list) else 1.0
    elif which == "mask":
        output.loss_masks[i] = [1]
    elif output.rollout_logprobs is not None:
        output.rollout_logprobs[i] = [-0.25]
    else:
        return False
    return True


CORRUPTIONS: list[Corruption] = [
    empty_response,
    extra_response_token,
    bad_token_id,
    empty_prompt,
    bad_mask_value,
    extra_mask_entry,
    bad_reward_value,
    switched_reward_kind,
    token_reward_of_wrong_length,
    bad_logprob,
    logprobs_of_wrong_length,
    bad_stop_reason,
    bad_placeholder_flag,
    bad_trajectory_id,
    reassigned_trajectory_id,
    bad_last_step_flag,
    bad_generation_time,
    bad_env_metrics_row,
    placeholder_with_real_values,
]


# Many examples: each of the 19 corruption kinds needs its share, in both modes. No deadline: the machine is
# shared and a slow example is not a failure.
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(valid_batches(), st.sampled_from(CORRUPTIONS), st.data())
def test_random_single_field_corruption_is_reported_naming_its_row(
    drawn: tuple[list[Trajectory | StepWiseTrajectory], Shape], corrupt: Corruption, data: st.DataObject
) -> None:
    items, shape = drawn
    output = build_batch_output(items)
    row = data.draw(st.integers(0, len(output) - 1), label="row")
    assume(corrupt(output, row, data))
    with pytest.raises(OutputValidationError) as info:
        validate_batch_output(output, len(items), step_wise=shape.step_wise)
    naming_row = re.compile(rf"\bsample {row}\b")
    assert any(naming_row.search(problem) for problem in info.value.problems), info.value.problems


@pytest.mark.parametrize(
    ("tid", "shown"),
    [
        (TrajectoryId(["a"], 0), "instance_id ['a'] and repetition 0 (int)"),  # type: ignore[arg-type]
        (TrajectoryId("a", 0.5), "instance_id 'a' (str) and repetition 0.5 (float)"),  # type: ignore[arg-type]
        (TrajectoryId("a", True), "instance_id 'a' (str) and repetition True (bool)"),
    ],
)
def test_a_trajectory_id_with_fields_of_the_wrong_type_is_reported_never_raised(
    tid: TrajectoryId, shown: str
) -> None:
    output = step_wise_batch()
    output.trajectory_ids[3] = output.trajectory_ids[4] = tid  # trajectory c's two steps
    expected = [f"sample {row}: trajectory_ids has {shown}, expected a str and an int" for row in (3, 4)]
    assert problems(output, step_wise=True) == expected


def test_skyrls_trajectory_ids_with_numpys_integers_are_read_as_trajectory_ids() -> None:
    @dataclass
    class SkyRLTrajectoryID:
        instance_id: str
        repetition_id: Any

    data = step_wise_batch().to_dict()
    data["trajectory_ids"] = [
        SkyRLTrajectoryID(t.instance_id, np.int64(t.repetition)) for t in data["trajectory_ids"]
    ]
    validate_batch_output(data, num_prompts=3, step_wise=True)
