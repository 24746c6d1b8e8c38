"""``RolloutContext``: everything one attempt at one rollout runs with, in one object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gym_resilience.backends.choice import BackendEnv, EnvFactory, make_env
from gym_resilience.backends.pool import WorkerPool
from gym_resilience.backends.protocol import StartAbort
from gym_resilience.config import RunnerConfig
from gym_resilience.engines.base import Engine, Sampling
from gym_resilience.rollout.codec import ChatCodec
from gym_resilience.rollout.env_calls import LateCloses
from gym_resilience.rollout.open_envs import OpenEnvs
from gym_resilience.rollout.pool import EnvPool
from gym_resilience.rollout.progress import Progress
from gym_resilience.rollout.start_line import StartLine
from gym_resilience.rollout.turn_line import TurnLine
from gym_resilience.tasks import Task
from gym_resilience.trajectories import TrajectoryId

__all__ = ["RolloutContext"]


@dataclass(frozen=True, slots=True)
class RolloutContext:
    """One attempt at one rollout: the batch's parts (engine, codec, env factory, config, env pool, late
    closes, open envs, start line, the runner's env workers) and the rollout's own (task, trajectory id,
    progress). A retry gets a new one with a fresh ``Progress``.
    """

    engine: Engine
    codec: ChatCodec
    env_factory: EnvFactory
    config: RunnerConfig
    pool: EnvPool
    late: LateCloses
    open_envs: OpenEnvs
    start_line: StartLine
    turn_line: TurnLine
    task: Task
    trajectory_id: TrajectoryId
    progress: Progress
    workers: WorkerPool[Any] | None = None

    @property
    def index(self) -> int:
        """The rollout's index in the batch (task x sample, in task order)."""
        return self.progress.rollout_index

    @property
    def seed(self) -> int | None:
        """``config.seed + index``: the RNG seed of the env's reset and of sampling (None without one)."""
        return self.config.rollout_seed(self.index)

    @property
    def sampling(self) -> Sampling:
        return self.config.sampling(self.index)

    def make_env(self, abort: StartAbort) -> BackendEnv:
        """The rollout's env, where the config says it runs (``abort`` kills a worker still starting)."""
        return make_env(self.env_factory, self.task, self.config, abort, self.workers)
