"""Small valid batches to break one field at a time, and the validator's verdict on them, for the
validator's tests."""

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

PAD = 0


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
