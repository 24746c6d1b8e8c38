"""gym_resilience: keep RL rollout pipelines for LLM agents alive when environments and inference fail."""

from gym_resilience.errors import (
    AllRolloutsFailedError,
    EnvClosedError,
    EnvCloseError,
    EnvError,
    EnvResetError,
    EnvStepError,
    EnvTimeoutError,
    FailureBudgetExceededError,
    GymResilienceError,
    OutputValidationError,
    RolloutError,
    RolloutTimeoutError,
    ScenarioError,
    UnsupportedConfigError,
)
from gym_resilience.tasks import Task
from gym_resilience.trajectories import (
    ROLLOUT_ERROR_STOP_REASON,
    BatchOutput,
    RolloutFailure,
    StepWiseTrajectory,
    Trajectory,
    TrajectoryId,
    build_batch_output,
)

__all__ = [
    "ROLLOUT_ERROR_STOP_REASON",
    "AllRolloutsFailedError",
    "BatchOutput",
    "EnvCloseError",
    "EnvClosedError",
    "EnvError",
    "EnvResetError",
    "EnvStepError",
    "EnvTimeoutError",
    "FailureBudgetExceededError",
    "GymResilienceError",
    "OutputValidationError",
    "RolloutError",
    "RolloutFailure",
    "RolloutTimeoutError",
    "ScenarioError",
    "StepWiseTrajectory",
    "Task",
    "Trajectory",
    "TrajectoryId",
    "UnsupportedConfigError",
    "build_batch_output",
]
