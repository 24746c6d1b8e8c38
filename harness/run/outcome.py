"""What one run of a scenario's batch left: its output or error, the firings, spans and env counts."""

from __future__ import annotations

from dataclasses import dataclass, field

from gym_resilience import AnyTrajectory, AttemptRecord, BatchOutput
from harness.faults.plan import FaultFiring
from harness.faults.spans import Span
from harness.run.endpoints import EndpointSpan

__all__ = ["ClusterNode", "RunOutcome"]


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
    envs_created: int
    envs_unclosed: int
    firings: list[FaultFiring] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
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
