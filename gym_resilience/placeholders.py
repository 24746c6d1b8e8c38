"""Failed-rollout markers and the placeholders that stand in for them.

:data:`PLACEHOLDER` says what every placeholder looks like; :func:`make_placeholder` builds one from it
and the validator's ``check_placeholder_*`` checks hold a batch to it. Substitution is a pure function,
run once every rollout finished; the reward shape is the config's (``token_level_rewards``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from gym_resilience.errors import Phase, exception_message, root_cause
from gym_resilience.trajectories import (
    ROLLOUT_ERROR_STOP_REASON,
    AnyTrajectory,
    RolloutFailure,
    StepWiseTrajectory,
    Trajectory,
    TrajectoryId,
)

__all__ = ["PLACEHOLDER", "FailedRollout", "PlaceholderShape", "make_placeholder", "substitute_placeholders"]


@dataclass(frozen=True, slots=True)
class PlaceholderShape:
    """What a placeholder is: one response token, masked out, with a zero reward and zero logprob, stopped
    with ``"rollout_error"``, and, step-wise, a trajectory of one step. It contributes neither reward nor
    loss."""

    response_length: int = 1
    loss_mask: tuple[int, ...] = (0,)
    reward: float = 0.0
    logprob: float = 0.0
    stop_reason: str = ROLLOUT_ERROR_STOP_REASON
    steps: int = 1

    def rewards(self, *, token_level: bool) -> float | list[float]:
        """The reward: a float, or one per response token."""
        return [self.reward] * self.response_length if token_level else self.reward

    def loss_masks(self) -> list[int]:
        return list(self.loss_mask)

    def logprobs(self) -> list[float]:
        return [self.logprob] * self.response_length


PLACEHOLDER: Final = PlaceholderShape()
"""The one shape of every placeholder."""


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


def make_placeholder(
    failure: FailedRollout,
    *,
    pad_token_id: int,
    token_level_rewards: bool,
    logprobs: bool,
    step_wise: bool,
) -> AnyTrajectory:
    """A fresh trajectory of :data:`PLACEHOLDER`'s shape for ``failure``.

    Every list is new, so an in-place edit of one placeholder never reaches another.
    """
    trajectory = Trajectory(
        prompt_ids=[pad_token_id],
        response_ids=[pad_token_id] * PLACEHOLDER.response_length,
        reward=PLACEHOLDER.rewards(token_level=token_level_rewards),
        loss_mask=PLACEHOLDER.loss_masks(),
        stop_reason=PLACEHOLDER.stop_reason,
        rollout_logprobs=PLACEHOLDER.logprobs() if logprobs else None,
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
    token_level_rewards: bool,
    logprobs: bool,
    step_wise: bool,
) -> list[AnyTrajectory]:
    """Replace each ``FailedRollout`` by a fresh placeholder; successful outputs pass through as they are."""
    return [
        make_placeholder(
            output,
            pad_token_id=pad_token_id,
            token_level_rewards=token_level_rewards,
            logprobs=logprobs,
            step_wise=step_wise,
        )
        if isinstance(output, FailedRollout)
        else output
        for output in outputs
    ]
