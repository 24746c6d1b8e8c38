"""What one run of a scenario's batch left: its output or error, the firings, spans and env counts."""

from __future__ import annotations

from dataclasses import dataclass, field

from gym_resilience import AnyTrajectory, BatchOutput
from harness.faults.plan import FaultFiring
from harness.faults.spans import Span
from harness.run.endpoints import EndpointSpan

__all__ = ["RunOutcome"]


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
