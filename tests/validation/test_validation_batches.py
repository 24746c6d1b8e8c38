"""Valid batches pass whole: ``BatchOutput``s, SkyRL's ``GeneratorOutput`` dicts, and the newer columns.

Messages are the contract (``sample <i>: <column> ...`` or ``batch: <column> ...``), so they are matched
exactly.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from small_batches import batch, passes, placeholder, problems, step_wise_batch, three_rows

from gym_resilience.errors import OutputValidationError
from gym_resilience.trajectories import (
    ROLLOUT_ERROR_STOP_REASON,
    BatchOutput,
    build_batch_output,
)
from gym_resilience.validation import (
    CHECKS,
    STEP_WISE_CHECKS,
    check_batch_size,
    validate_batch_output,
)

# A valid batch must not warn either, unless a test says so.
pytestmark = pytest.mark.filterwarnings("error::gym_resilience.validation.OutputValidationWarning")


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


@pytest.mark.parametrize(
    "value", [[], (), "batch", 3, None, object()], ids=["list", "tuple", "str", "int", "None", "object"]
)
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
