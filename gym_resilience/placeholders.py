"""Failed-rollout markers and the placeholders that stand in for them.

Pure functions: substitution happens after every rollout finished, because the reward shape
(trajectory- or token-level) is only known from a successful rollout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gym_resilience.errors import Phase, exception_message, root_cause
from gym_resilience.trajectories import (
    ROLLOUT_ERROR_STOP_REASON,
    AnyTrajectory,
    RolloutFailure,
    StepWiseTrajectory,
    Trajectory,
    TrajectoryId,
)

__all__ = ["FailedRollout", "make_placeholder", "reward_is_token_level", "substitute_placeholders"]


@dataclass(frozen=True, slots=True)
class FailedRollout:
    """Returned in place of a rollout that raised under ``skip_failed_rollouts``.

    ``elapsed_s`` is the rollout's measured time until it failed: a placeholder reports it as its
    ``e2e_time``, so completion-time metrics stay complete.
    """

    exception: Exception
    rollout_index: int
    trajectory_id: TrajectoryId
    phase: Phase
    turn: int | None
    elapsed_s: float
    attempts: int = 1

    def describe(self) -> RolloutFailure:
        """The failure as plain data; never raises, whatever the exception's ``__str__`` does."""
        cause = root_cause(self.exception)
        return RolloutFailure(
            error_type=type(self.exception).__name__,
            message=exception_message(self.exception),
            phase=self.phase,
            turn=self.turn,
            root_cause_type=type(cause).__name__,
            root_cause_message=exception_message(cause),
        )


def _first_trajectory(output: AnyTrajectory) -> Trajectory | None:
    if isinstance(output, StepWiseTrajectory):
        return output.steps[0] if output.steps else None
    return output


def reward_is_token_level(outputs: Sequence[AnyTrajectory | FailedRollout]) -> bool:
    """The batch's reward shape, read off the first successful output with at least one step.

    With none (every success has no steps), rewards are trajectory-level.
    """
    for output in outputs:
        if isinstance(output, FailedRollout):
            continue
        first = _first_trajectory(output)
        if first is not None:
            return isinstance(first.reward, list)
    return False


def make_placeholder(
    failure: FailedRollout,
    *,
    pad_token_id: int,
    token_level_rewards: bool,
    logprobs: bool,
    step_wise: bool,
) -> AnyTrajectory:
    """A fresh one-token trajectory that contributes neither reward nor loss.

    Every list is new, so an in-place edit of one placeholder never reaches another.
    """
    trajectory = Trajectory(
        prompt_ids=[pad_token_id],
        response_ids=[pad_token_id],
        reward=[0.0] if token_level_rewards else 0.0,
        loss_mask=[0],
        stop_reason=ROLLOUT_ERROR_STOP_REASON,
        rollout_logprobs=[0.0] if logprobs else None,
        env_metrics={},
        e2e_time=failure.elapsed_s,
        time_splits=None,
        trajectory_id=failure.trajectory_id,
        is_placeholder=True,
        failure=failure.describe(),
    )
    if step_wise:
        return StepWiseTrajectory(
            steps=[trajectory],
            e2e_time=failure.elapsed_s,
            trajectory_id=failure.trajectory_id,
            is_placeholder=True,
        )
    return trajectory


def substitute_placeholders(
    outputs: Sequence[AnyTrajectory | FailedRollout],
    *,
    pad_token_id: int,
    logprobs: bool,
    step_wise: bool,
) -> list[AnyTrajectory]:
    """Replace each ``FailedRollout`` by a fresh placeholder; successful outputs pass through as they are."""
    token_level = reward_is_token_level(outputs)
    return [
        make_placeholder(
            output,
            pad_token_id=pad_token_id,
            token_level_rewards=token_level,
            logprobs=logprobs,
            step_wise=step_wise,
        )
        if isinstance(output, FailedRollout)
        else output
        for output in outputs
    ]
