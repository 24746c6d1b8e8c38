"""What a chaos run observed and concluded: plain records the reports (terminal, JSON journal, JUnit,
timelines) read.

Times are seconds: ``*_s`` fields are measurements and are the only fields that differ between two
runs of the same suite (the journal's determinism check ignores them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from harness.faults.events import FaultFiring
from harness.run.endpoints import EndpointSpan
from harness.run.outcome import ClusterNode

__all__ = [
    "Attempt",
    "ClusterNode",
    "EndpointSpan",
    "FaultFiring",
    "ProbeResult",
    "RolloutSpan",
    "RunJournal",
    "ScenarioResult",
    "Status",
    "TurnSpan",
]

Status = Literal["held", "deviated", "invalid", "error"]
"""held: every probe and the expected outcome held; deviated: one did not; invalid: the file is not a
valid scenario; error: the harness itself failed to run it (the message says why)."""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One probe: observed against expected (``describe()`` of the tolerance), whether it held, and
    for some probes a ``detail`` (``identical_to_baseline``: where the runs first differ)."""

    probe: str
    expected: str
    observed: Any
    held: bool
    detail: str = ""
    """Where the observation comes from, when a value alone does not say (the first difference)."""


@dataclass(frozen=True, slots=True)
class TurnSpan:
    """One engine call or env call of a rollout in the faulted run, as offsets from the run's start."""

    kind: Literal["generate", "reset", "step", "close"]
    turn: int | None
    attempt: int
    start_s: float
    end_s: float
    failed: bool
    node: str | None = None
    """The Ray node the env of this call's attempt ran on (its env calls ran there; engine calls run
    wherever the engine does), from the runner's attempt record; None off Ray or when not known."""


@dataclass(frozen=True, slots=True)
class Attempt:
    """One attempt at one rollout, as ``BatchRunner`` recorded it (``BatchResult.attempts``), failed ones
    included: where its env ran, where it ended (``phase``), how long it took and what it raised."""

    rollout: int
    attempt: int
    node: str | None
    """The Ray node the attempt's env actor was placed on (``runner.env_backend: ray``), known once it was
    placed, whether or not the attempt got to ``reset``; None off Ray, or for an actor never placed."""
    phase: str
    elapsed_s: float
    error: str | None
    """``Type: message`` of what the attempt raised; None if it returned a trajectory."""


@dataclass(slots=True)
class RolloutSpan:
    """One rollout of the faulted run: its calls, whether a placeholder stands in for it, its error."""

    index: int
    spans: list[TurnSpan] = field(default_factory=list)
    placeholder: bool = False
    error: str | None = None


@dataclass(slots=True)
class ScenarioResult:
    """The outcome of one scenario file; ``spec`` is the scenario as run (``chaos record`` reads it)."""

    file: str
    title: str
    status: Status
    probes: list[ProbeResult] = field(default_factory=list)
    firings: list[FaultFiring] = field(default_factory=list)
    rollouts: list[RolloutSpan] = field(default_factory=list)
    outcome: str = ""
    message: str = ""
    baseline_s: float = 0.0
    faulted_s: float = 0.0
    spec: dict[str, Any] = field(default_factory=dict)
    baseline_rollouts: list[RolloutSpan] = field(default_factory=list)
    """The fault-free baseline run's rollouts, built as ``rollouts`` is from the faulted run."""
    endpoints: list[EndpointSpan] = field(default_factory=list)
    """The faulted run's served endpoints; empty for an in-process engine."""
    attempts: list[Attempt] = field(default_factory=list)
    """Every attempt of every rollout of the faulted run, in rollout and attempt order; empty when the
    batch raised (``BatchRunner`` returned no result) or a user pipeline ran."""
    baseline_attempts: list[Attempt] = field(default_factory=list)
    """The same for the fault-free baseline run."""
    nodes: list[ClusterNode] = field(default_factory=list)
    """The nodes of the scenario's Ray cluster (head first); empty without a ``cluster``."""

    def deviations(self) -> list[ProbeResult]:
        return [probe for probe in self.probes if not probe.held]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class RunJournal:
    """One ``chaos run``: its settings and every scenario's result, in file order."""

    device: str
    scenarios: list[ScenarioResult] = field(default_factory=list)
    started_at: str = ""
    total_s: float = 0.0

    @property
    def status(self) -> Status:
        statuses = {result.status for result in self.scenarios}
        worst: tuple[Status, ...] = ("invalid", "error", "deviated")
        return next((status for status in worst if status in statuses), "held")

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "device": self.device,
            "started_at": self.started_at,
            "total_s": self.total_s,
            "scenarios": [result.to_json() for result in self.scenarios],
        }
