"""The checks of placeholder rows: the shape SkyRL's generator gives a failed rollout, and only there.

Messages are the contract (``sample <i>: <column> ...`` or ``batch: <column> ...``), so they are matched
exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
from small_batches import PAD, A, batch, passes, placeholder, problems, real, three_rows

from gym_resilience.trajectories import (
    ROLLOUT_ERROR_STOP_REASON,
    BatchOutput,
    StepWiseTrajectory,
    TrajectoryId,
    build_batch_output,
)
from gym_resilience.validation import (
    OutputValidationWarning,
)

# A valid batch must not warn either, unless a test says so.
pytestmark = pytest.mark.filterwarnings("error::gym_resilience.validation.OutputValidationWarning")


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
