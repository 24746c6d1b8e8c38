"""Trajectory types and the columnar ``BatchOutput`` a trainer consumes (DESIGN.md §2).

Field names and meanings follow the seed's framework, so a trainer that consumes that format consumes
this one. Trajectories are plain mutable dataclasses: trainers edit rewards and masks in place, which is
why every placeholder is a fresh object.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

from gym_resilience.errors import Phase

__all__ = [
    "ROLLOUT_ERROR_STOP_REASON",
    "AnyTrajectory",
    "BatchOutput",
    "RolloutFailure",
    "StepWiseTrajectory",
    "Trajectory",
    "TrajectoryId",
    "build_batch_output",
    "without_timings",
]

ROLLOUT_ERROR_STOP_REASON: Final = "rollout_error"
"""The stop reason of a placeholder trajectory; any reason but ``"stop"`` counts as non-stop."""


@dataclass(frozen=True, slots=True)
class TrajectoryId:
    """Names one sample: the task's instance id and which repetition of it."""

    instance_id: str
    repetition: int = 0

    def __str__(self) -> str:
        return f"{self.instance_id}_{self.repetition}"


@dataclass(frozen=True, slots=True)
class RolloutFailure:
    """What a placeholder stands for: the failure of its rollout.

    ``error_type`` and ``message`` are the failure as raised (``EnvStepError``, whose message ends with
    its root cause); ``root_cause_type`` and ``root_cause_message`` are what actually went wrong (the
    innermost foreign ``__cause__``, e.g. ``ConnectionError``; the failure itself when it has none).
    """

    error_type: str
    message: str
    phase: Phase
    turn: int | None
    root_cause_type: str
    root_cause_message: str


@dataclass(slots=True)
class Trajectory:
    """One rollout (or, step-wise, one turn of it) in token space.

    ``loss_mask`` is 1 for tokens the policy generated and 0 for tokens the env wrote; ``reward`` is a
    float (trajectory-level) or one float per response token (token-level).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    reward: float | list[float]
    loss_mask: list[int]
    stop_reason: str
    rollout_logprobs: list[float] | None = None
    env_metrics: dict[str, Any] = field(default_factory=dict)
    e2e_time: float | None = None
    time_splits: dict[str, float] | None = None
    trajectory_id: TrajectoryId | None = None
    is_placeholder: bool = False
    failure: RolloutFailure | None = None


@dataclass(slots=True)
class StepWiseTrajectory:
    """One rollout as one ``Trajectory`` per turn, for step-wise training."""

    steps: list[Trajectory]
    e2e_time: float | None = None
    trajectory_id: TrajectoryId | None = None
    is_placeholder: bool = False


AnyTrajectory = Trajectory | StepWiseTrajectory


@dataclass(slots=True)
class BatchOutput:
    """The columnar batch a trainer consumes; one row per sample (step-wise: per step).

    ``is_last_step`` is set only for step-wise batches. ``is_placeholder`` marks rows that stand for a
    failed rollout. ``trajectory_generation_times`` is each row's rollout ``e2e_time``, or None when any
    row lacks one.
    """

    prompt_token_ids: list[list[int]]
    response_ids: list[list[int]]
    rewards: list[float | list[float]]
    loss_masks: list[list[int]]
    stop_reasons: list[str]
    rollout_logprobs: list[list[float]] | None
    trajectory_ids: list[TrajectoryId | None]
    is_last_step: list[bool] | None = None
    is_placeholder: list[bool] = field(default_factory=list)
    rollout_metrics: dict[str, float] = field(default_factory=dict)
    trajectory_generation_times: list[float] | None = None

    def __len__(self) -> int:
        return len(self.response_ids)


def _rows(trajectories: Iterable[AnyTrajectory]) -> Iterable[tuple[Trajectory, bool, float | None]]:
    """Each row's trajectory, whether it ends its rollout, and its rollout's e2e time."""
    for trajectory in trajectories:
        if isinstance(trajectory, StepWiseTrajectory):
            last = len(trajectory.steps) - 1
            for index, step in enumerate(trajectory.steps):
                yield step, index == last, trajectory.e2e_time
        else:
            yield trajectory, True, trajectory.e2e_time


def build_batch_output(
    trajectories: Sequence[AnyTrajectory], *, rollout_metrics: dict[str, float] | None = None
) -> BatchOutput:
    """Lay trajectories out as columns; step-wise trajectories give one row per step.

    Columns are copies of the lists in the trajectories, so editing one side leaves the other alone.
    A batch is step-wise when any trajectory is a ``StepWiseTrajectory``.
    """
    step_wise = any(isinstance(t, StepWiseTrajectory) for t in trajectories)
    rows = list(_rows(trajectories))
    steps = [step for step, _, _ in rows]
    logprobs = [step.rollout_logprobs for step in steps]
    times = [e2e for _, _, e2e in rows]
    return BatchOutput(
        prompt_token_ids=[list(step.prompt_ids) for step in steps],
        response_ids=[list(step.response_ids) for step in steps],
        rewards=[_copy_reward(step.reward) for step in steps],
        loss_masks=[list(step.loss_mask) for step in steps],
        stop_reasons=[step.stop_reason for step in steps],
        rollout_logprobs=None if all(lp is None for lp in logprobs) else [list(lp or []) for lp in logprobs],
        trajectory_ids=[step.trajectory_id for step in steps],
        is_last_step=[last for _, last, _ in rows] if step_wise else None,
        is_placeholder=[step.is_placeholder for step in steps],
        rollout_metrics=dict(rollout_metrics or {}),
        trajectory_generation_times=None if None in times else [float(t or 0.0) for t in times],
    )


def _copy_reward(reward: float | list[float]) -> float | list[float]:
    return list(reward) if isinstance(reward, list) else reward


def without_timings(trajectory: AnyTrajectory) -> AnyTrajectory:
    """A copy with the measured times cleared, to compare what two runs generated token for token."""
    if isinstance(trajectory, StepWiseTrajectory):
        return replace(
            trajectory,
            steps=[replace(s, e2e_time=None, time_splits=None) for s in trajectory.steps],
            e2e_time=None,
        )
    return replace(trajectory, e2e_time=None, time_splits=None)
