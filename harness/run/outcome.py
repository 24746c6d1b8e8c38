"""What one run of a scenario's batch left: its output or error, its recording (firings, spans, env
counts), and the end of each rollout, keyed by the rollout index the runner gave it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gym_resilience import AnyTrajectory, AttemptRecord, BatchOutput, BatchResult, StepWiseTrajectory
from harness.run.endpoints import EndpointSpan
from harness.run.recorder import Recording

__all__ = ["ClusterNode", "RolloutEnds", "RunOutcome"]


@dataclass(frozen=True)
class RolloutEnds:
    """How the rollouts of a run ended, by rollout index: which ones a placeholder stands in for, and
    ``Type: message`` (the message ends with the root cause) of each one's failure record."""

    placeholders: frozenset[int] = frozenset()
    failures: Mapping[int, str] = field(default_factory=dict)

    @classmethod
    def of_batch(cls, result: BatchResult) -> RolloutEnds:
        """From ``BatchRunner``'s own records: a placeholder stands in for each of its failures."""
        described = {failure.rollout_index: failure.describe() for failure in result.failures}
        return cls(
            placeholders=frozenset(described),
            failures={index: f"{d.error_type}: {d.message}" for index, d in described.items()},
        )

    @classmethod
    def of_pipeline(
        cls,
        trajectories: Sequence[AnyTrajectory],
        output: BatchOutput,
        index_of: Mapping[str, int],
        samples: int,
    ) -> RolloutEnds:
        """From what a user pipeline returned, where no runner gave rollout indices: a row's rollout is
        ``task index x samples + repetition`` by its trajectory id, or its position in the batch when it
        has none (a step-wise rollout's rows end at ``is_last_step``)."""
        placeholders = set()
        position = 0
        for row in range(len(output)):
            trajectory_id = output.trajectory_ids[row] if row < len(output.trajectory_ids) else None
            if output.is_placeholder[row]:
                placeholders.add(_rollout_of(trajectory_id, position, index_of, samples))
            last = output.is_last_step[row] if output.is_last_step is not None else True
            position += 1 if last else 0
        failures: dict[int, str] = {}
        for position, trajectory in enumerate(trajectories):
            steps = trajectory.steps if isinstance(trajectory, StepWiseTrajectory) else [trajectory]
            failure = next((step.failure for step in steps if step.failure is not None), None)
            if failure is not None:
                rollout = _rollout_of(trajectory.trajectory_id, position, index_of, samples)
                failures[rollout] = f"{failure.error_type}: {failure.message}"
        return cls(placeholders=frozenset(placeholders), failures=failures)


def _rollout_of(trajectory_id: Any, fallback: int, index_of: Mapping[str, int], samples: int) -> int:
    instance_id = getattr(trajectory_id, "instance_id", None)
    repetition = getattr(trajectory_id, "repetition", 0)
    if (
        isinstance(instance_id, str)
        and instance_id in index_of
        and isinstance(repetition, int)
        and 0 <= repetition < samples
    ):
        return index_of[instance_id] * samples + repetition
    return fallback


@dataclass(frozen=True, slots=True)
class ClusterNode:
    """One node of the scenario's local Ray cluster: its id, its role (``head``, ``worker 0``, ... in the
    order the cluster added them, as ``kill_node`` faults number them) and whether the faulted run
    removed it."""

    node: str
    role: str
    removed: bool = False


@dataclass
class RunOutcome:
    """One run of a scenario's batch: what it produced or raised, and what it left behind."""

    trajectories: list[AnyTrajectory] | None
    output: BatchOutput | None
    metrics: dict[str, float]
    error: BaseException | None
    wall_s: float
    recording: Recording = field(default_factory=Recording)
    """The run's firings, spans and env counts."""
    ends: RolloutEnds = field(default_factory=RolloutEnds)
    """Which rollouts a placeholder stands in for and why they failed; empty when the batch raised."""
    failovers: int = 0
    end_s: float | None = None
    endpoints: list[EndpointSpan] = field(default_factory=list)
    """Served endpoints' stretches out of rotation and failovers (none for an in-process engine)."""
    actors_alive: int | None = None
    """Ray actors of the scenario's cluster still alive after the run; None without a cluster."""
    head_node: str | None = None
    """The id of the scenario's cluster's head node; None without a cluster."""
    attempts: list[AttemptRecord] = field(default_factory=list)
    """``BatchResult.attempts``: every attempt of every rollout, failed ones included, with the Ray node
    its env actor was placed on; empty when the batch raised or a user pipeline ran."""
    nodes: list[ClusterNode] = field(default_factory=list)
    """The scenario's cluster's nodes, head first, and whether this run removed them; empty without one."""
