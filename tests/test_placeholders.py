"""Placeholders: every one has PLACEHOLDER's shape, and the validator holds a batch to that same shape."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gym_resilience import StepWiseTrajectory, Trajectory, TrajectoryId, build_batch_output
from gym_resilience.placeholders import PLACEHOLDER, FailedRollout, make_placeholder, substitute_placeholders
from gym_resilience.validation import (
    check_placeholder_logprobs,
    check_placeholder_loss_masks,
    check_placeholder_responses,
    check_placeholder_rewards,
)


def _failure(index: int = 0) -> FailedRollout:
    return FailedRollout(ConnectionError("gone"), index, TrajectoryId(f"t{index}"), "step", 1, 0.5)


@pytest.mark.parametrize("token_level", [False, True])
def test_a_placeholder_has_the_one_shape_in_either_reward_shape(token_level: bool) -> None:
    placeholder = make_placeholder(
        _failure(), pad_token_id=7, token_level_rewards=token_level, logprobs=True, step_wise=False
    )
    assert isinstance(placeholder, Trajectory) and placeholder.is_placeholder
    assert placeholder.response_ids == [7] * PLACEHOLDER.response_length
    assert placeholder.loss_mask == [0] and placeholder.rollout_logprobs == [0.0]
    assert placeholder.reward == ([0.0] if token_level else 0.0)
    assert placeholder.stop_reason == "rollout_error" and placeholder.e2e_time == 0.5
    assert placeholder.failure is not None and placeholder.failure.root_cause_type == "ConnectionError"


def test_placeholders_never_share_a_list() -> None:
    first, second = substitute_placeholders(
        [_failure(0), _failure(1)], pad_token_id=0, token_level_rewards=True, logprobs=False, step_wise=False
    )
    assert isinstance(first, Trajectory) and isinstance(second, Trajectory)
    first.loss_mask.append(1)
    assert second.loss_mask == [0]


def test_the_reward_shape_is_the_configs_whatever_the_successes_hold() -> None:
    success = Trajectory(prompt_ids=[1], response_ids=[2], reward=1.0, loss_mask=[1], stop_reason="stop")
    _, placeholder = substitute_placeholders(
        [success, _failure()], pad_token_id=0, token_level_rewards=True, logprobs=False, step_wise=False
    )
    assert isinstance(placeholder, Trajectory) and placeholder.reward == [0.0]


def test_a_step_wise_placeholder_is_a_trajectory_of_one_step() -> None:
    placeholder = make_placeholder(
        _failure(), pad_token_id=0, token_level_rewards=False, logprobs=False, step_wise=True
    )
    assert isinstance(placeholder, StepWiseTrajectory) and len(placeholder.steps) == PLACEHOLDER.steps


def test_the_validator_accepts_a_placeholder_and_names_each_part_that_leaves_the_shape() -> None:
    placeholder = make_placeholder(
        _failure(), pad_token_id=0, token_level_rewards=False, logprobs=True, step_wise=False
    )
    assert isinstance(placeholder, Trajectory)
    output = build_batch_output([placeholder])
    checks = (check_placeholder_responses, check_placeholder_loss_masks, check_placeholder_rewards)
    assert [problem for check in (*checks, check_placeholder_logprobs) for problem in check(output)] == []
    bent = replace(
        placeholder, response_ids=[0, 0], loss_mask=[1, 0], reward=0.5, rollout_logprobs=[0.0, 0.0]
    )
    output = build_batch_output([bent])
    assert [problem for check in checks for problem in check(output)] == [
        "sample 0: response_ids of a placeholder has 2 tokens, expected exactly 1",
        "sample 0: loss_masks of a placeholder is [1, 0], expected [0]",
        "sample 0: rewards of a placeholder is 0.5 (float), expected 0.0 or [0.0]",
    ]
