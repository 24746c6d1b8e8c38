"""gym_resilience: keep RL rollout pipelines for LLM agents alive when environments and inference fail."""

from gym_resilience.advantages import (
    FailedGroupPolicy,
    GroupAdvantages,
    GroupStats,
    group_relative_advantages,
)
from gym_resilience.backends.resilient import ResilientEnv
from gym_resilience.config import RunnerConfig
from gym_resilience.errors import (
    AllRolloutsFailedError,
    DependencyNotInstalledError,
    EngineClosedError,
    EngineDeadError,
    EngineError,
    EngineRequestError,
    EnvClosedError,
    EnvCloseError,
    EnvError,
    EnvResetError,
    EnvStepError,
    EnvTimeoutError,
    EnvWorkerDiedError,
    FailureBudgetExceededError,
    GymResilienceError,
    OutputValidationError,
    RolloutError,
    RolloutTimeoutError,
    UnpicklableEnvError,
    UnsupportedConfigError,
    describe_exception,
    root_cause,
)
from gym_resilience.retry import RetryPolicy
from gym_resilience.rollout import Progress, current_rollout, rollout_headers
from gym_resilience.runner import AttemptRecord, BatchResult, BatchRunner
from gym_resilience.tasks import Task
from gym_resilience.trajectories import (
    ROLLOUT_ERROR_STOP_REASON,
    AnyTrajectory,
    BatchOutput,
    RolloutFailure,
    StepWiseTrajectory,
    Trajectory,
    TrajectoryId,
    build_batch_output,
    without_timings,
)
from gym_resilience.validation import OutputValidationWarning, validate_batch_output

__all__ = [
    "ROLLOUT_ERROR_STOP_REASON",
    "AllRolloutsFailedError",
    "AnyTrajectory",
    "AttemptRecord",
    "BatchOutput",
    "BatchResult",
    "BatchRunner",
    "DependencyNotInstalledError",
    "EngineClosedError",
    "EngineDeadError",
    "EngineError",
    "EngineRequestError",
    "EnvCloseError",
    "EnvClosedError",
    "EnvError",
    "EnvResetError",
    "EnvStepError",
    "EnvTimeoutError",
    "EnvWorkerDiedError",
    "FailedGroupPolicy",
    "FailureBudgetExceededError",
    "GroupAdvantages",
    "GroupStats",
    "GymResilienceError",
    "OutputValidationError",
    "OutputValidationWarning",
    "Progress",
    "RayEnv",
    "ResilientEnv",
    "RetryPolicy",
    "RolloutError",
    "RolloutFailure",
    "RolloutTimeoutError",
    "RunnerConfig",
    "ScenarioError",
    "StepWiseTrajectory",
    "Task",
    "Trajectory",
    "TrajectoryId",
    "UnpicklableEnvError",
    "UnsupportedConfigError",
    "build_batch_output",
    "current_rollout",
    "describe_exception",
    "group_relative_advantages",
    "rollout_headers",
    "root_cause",
    "validate_batch_output",
    "without_timings",
]


def __getattr__(name: str) -> object:
    # RayEnv on first use only: importing gym_resilience must not import ray (or need it installed).
    if name == "RayEnv":
        from gym_resilience.backends.ray import RayEnv

        return RayEnv
    # The harness's error, kept here for scenario code written against it; the library never raises it.
    if name == "ScenarioError":
        from harness.errors import ScenarioError

        return ScenarioError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
