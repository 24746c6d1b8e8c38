"""The probes a scenario may check: one registry of each probe's name, what it observes, and how.

The scenario models accept exactly these names (and ``metrics.<key>``), :func:`observe` computes
every one of them from a scenario's two runs, and docs/scenarios.md documents this table (a test
checks that the two agree).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from gym_resilience import (
    AttemptRecord,
    OutputValidationError,
    describe_exception,
    group_relative_advantages,
    validate_batch_output,
)
from harness.judge.compare import Comparison
from harness.run.outcome import RunOutcome
from harness.scenario.probe_names import METRICS_PREFIX, is_probe

__all__ = [
    "METRICS_PREFIX",
    "PROBES",
    "REGISTRY",
    "Observations",
    "ProbeDefinition",
    "RunOutcome",
    "Runs",
    "attempt_nodes",
    "is_counter",
    "is_probe",
    "observations",
    "observe",
]

COUNTERS: Final = frozenset({"retries", "retries/rollouts", "retries/succeeded", "retries/exhausted"})
COUNTER_FAMILIES: Final = ("rollout_errors/type/", "rollout_errors/cause/", "rollout_errors/phase/")
"""The runner metrics that count something and that ``gym_resilience.metrics.batch_metrics`` leaves out
of a batch's metrics when the count is zero: the retry counts, and the failed rollouts by type, root
cause and phase (one key per name that occurred)."""


@dataclass(frozen=True)
class Runs:
    """What the probes observe: both runs of a scenario and what was derived from them."""

    baseline: RunOutcome
    faulted: RunOutcome
    comparison: Comparison
    num_prompts: int
    """Rows the trainer sent: tasks x samples per task."""
    step_wise: bool
    injected_latency_s: float | None
    """The most network latency the faults injected into one rollout; None when none hit a rollout."""


@dataclass(frozen=True)
class ProbeDefinition:
    """A probe: its name in scenario files, what it observes (the documentation's words), and how."""

    name: str
    description: str
    observe: Callable[[Runs], Any]


def _placeholders(runs: Runs) -> int | None:
    output = runs.faulted.output
    return None if output is None else sum(1 for flag in output.is_placeholder if flag)


def _placeholder_rollouts(runs: Runs) -> str | None:
    output = runs.faulted.output
    if output is None:
        return None
    rollouts, rollout = [], 0
    for row, placeholder in enumerate(output.is_placeholder):
        if placeholder and rollout not in rollouts:
            rollouts.append(rollout)
        # A step-wise rollout's rows end at its last step.
        if output.is_last_step is None or output.is_last_step[row]:
            rollout += 1
    return ", ".join(str(index) for index in rollouts)


def _validator_passes(runs: Runs) -> bool:
    output = runs.faulted.output
    if output is None:
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            validate_batch_output(output, runs.num_prompts, step_wise=runs.step_wise)
    except OutputValidationError:
        return False
    return True


def _logprobs_per_token(runs: Runs) -> bool:
    output = runs.faulted.output
    if output is None or output.rollout_logprobs is None:
        return False
    return all(
        len(lps) == len(ids) and all(math.isfinite(lp) and lp <= 0 for lp in lps)
        for lps, ids in zip(output.rollout_logprobs, output.response_ids, strict=True)
    )


def _masked_groups(runs: Runs) -> int | None:
    output = runs.faulted.output
    if output is None or runs.step_wise:
        return None
    return len(group_relative_advantages(output, failed_group_policy="mask_group").masked_groups)


def attempt_nodes(attempts: Iterable[AttemptRecord]) -> dict[tuple[int, int], str]:
    """The Ray node each (rollout, attempt) ran on, from the runner's attempt records: the node its env
    actor was placed on, known as soon as it was placed, whether or not the attempt got as far as
    ``reset``. An attempt whose node is not known (off Ray, an actor never placed) is left out."""
    return {
        (record.rollout_index, record.attempt): record.node_id
        for record in attempts
        if record.node_id is not None
    }


def _actors_left_alive(runs: Runs) -> int | None:
    counts = [run.actors_alive for run in (runs.baseline, runs.faulted) if run.actors_alive is not None]
    return sum(counts) if counts else None


def _retries_moved_node(runs: Runs) -> int:
    nodes = attempt_nodes(runs.faulted.attempts)
    return sum(
        1
        for (rollout, attempt), node in nodes.items()
        if attempt > 0 and nodes.get((rollout, attempt - 1), node) != node
    )


def _nodes_used(runs: Runs) -> int:
    return len(set(attempt_nodes(runs.faulted.attempts).values()))


def _envs_on_head_node(runs: Runs) -> int | None:
    head = runs.faulted.head_node
    if head is None:
        return None
    return sum(1 for node in attempt_nodes(runs.faulted.attempts).values() if node == head)


def _ratio(numerator: float, denominator: float | None) -> float | None:
    return numerator / denominator if denominator else None


REGISTRY: Final[tuple[ProbeDefinition, ...]] = (
    ProbeDefinition(
        "batch_size",
        "trajectories in the faulted batch",
        lambda runs: len(runs.faulted.output) if runs.faulted.output is not None else None,
    ),
    ProbeDefinition(
        "validator_passes", "the faulted batch passes `validate_batch_output`", _validator_passes
    ),
    ProbeDefinition("failed", "rollouts that failed (placeholders stand in for them)", _placeholders),
    ProbeDefinition(
        "placeholders",
        "placeholder rows in the faulted batch (its `is_placeholder` column, whoever built it)",
        _placeholders,
    ),
    ProbeDefinition(
        "placeholder_rollouts",
        "the rollouts placeholders stand in for, by position in the faulted batch, as text: `1, 4` "
        "(`''`: none)",
        _placeholder_rollouts,
    ),
    ProbeDefinition(
        "envs_unclosed",
        "envs created but never closed, over both runs (must be 0 for `BatchRunner`)",
        lambda runs: runs.baseline.recording.envs_unclosed + runs.faulted.recording.envs_unclosed,
    ),
    ProbeDefinition(
        "identical_to_baseline",
        "every successful trajectory equals the fault-free run's, token for token, up to numerical ties "
        "(below); a deviation names the first differing rollout, turn, token index and both token ids",
        lambda runs: runs.comparison.identical,
    ),
    ProbeDefinition(
        "numerical_ties",
        "successful trajectories that left the baseline's tokens at a numerical tie (below)",
        lambda runs: len(runs.comparison.ties) if runs.comparison.identical is not None else None,
    ),
    ProbeDefinition(
        "error_type",
        "the type name of the error the faulted run raised (`none`: it completed)",
        lambda runs: type(runs.faulted.error).__name__ if runs.faulted.error is not None else "none",
    ),
    ProbeDefinition(
        "wall_time_ratio",
        "the faulted run's wall time over the fault-free run's. Machine load moves both runs unevenly "
        "(a loaded baseline beside a quiet faulted run can give 0.2), so use it only with wide tolerances",
        lambda runs: _ratio(runs.faulted.wall_s, runs.baseline.wall_s),
    ),
    ProbeDefinition(
        "wall_over_injected_latency",
        "the faulted run's wall time over the most network latency injected into one rollout. A "
        "rollout's requests run one after another, so `gte: 1` proves the latency was applied, and load "
        "can only raise it",
        lambda runs: _ratio(runs.faulted.wall_s, runs.injected_latency_s),
    ),
    ProbeDefinition(
        "retries",
        "rollout retries in the faulted run",
        lambda runs: runs.faulted.metrics.get("retries", 0.0),
    ),
    ProbeDefinition(
        "retries_succeeded",
        "retried rollouts that then succeeded",
        lambda runs: runs.faulted.metrics.get("retries/succeeded", 0.0),
    ),
    ProbeDefinition(
        "retries_moved_node",
        "retries whose env ran on another Ray node than the attempt before it (`runner.env_backend: ray`)",
        _retries_moved_node,
    ),
    ProbeDefinition(
        "nodes_used",
        "Ray nodes the faulted run's envs ran on (`runner.env_backend: ray`)",
        _nodes_used,
    ),
    ProbeDefinition(
        "envs_on_head_node",
        "attempts of the faulted run whose env ran on the cluster's head node, where the driver runs",
        _envs_on_head_node,
    ),
    ProbeDefinition(
        "actors_left_alive",
        "Ray actors still alive after each run, over both runs (with a `cluster`; must be 0)",
        _actors_left_alive,
    ),
    ProbeDefinition(
        "failovers",
        "requests a served engine moved to another endpoint",
        lambda runs: runs.faulted.failovers,
    ),
    ProbeDefinition(
        "faults_fired", "times any fault fired", lambda runs: len(runs.faulted.recording.firings)
    ),
    ProbeDefinition(
        "masked_groups",
        "groups whose loss masks the `mask_group` policy zeroed (group-relative advantages)",
        _masked_groups,
    ),
    ProbeDefinition(
        "token_level_rewards",
        "every reward is a per-token list",
        lambda runs: (
            runs.faulted.output is not None
            and all(isinstance(reward, list) for reward in runs.faulted.output.rewards)
        ),
    ),
    ProbeDefinition(
        "logprobs_per_token",
        "every row has one finite logprob <= 0 per response token",
        _logprobs_per_token,
    ),
)
"""Every probe, in the order the documentation lists them."""

PROBES: Final[Mapping[str, str]] = {probe.name: probe.description for probe in REGISTRY}
"""Every probe's name and what it observes."""


def is_counter(key: str) -> bool:
    """Whether the runner metric ``key`` is a count the runner leaves out when it is zero (``COUNTERS``)."""
    return key in COUNTERS or any(key.startswith(f) and len(key) > len(f) for f in COUNTER_FAMILIES)


@dataclass(frozen=True)
class Observations:
    """Every probe's observation of a scenario's runs, and why the ones that could not be computed for
    this batch observe None."""

    values: dict[str, Any]
    unobservable: dict[str, str]
    """Why, by probe name: the error computing it raised (``masked_groups`` of rows without ids)."""


def observations(runs: Runs, probes: Iterable[str] = ()) -> Observations:
    """Every probe's observation of a scenario's runs (None where a probe has nothing to observe, or
    cannot be computed for this batch: only a probe that asks for it is affected), ``metrics.<key>``
    for every runner metric of the faulted run, and 0.0 for each counter ``probes`` name that
    ``BatchRunner``'s metrics leave out because it is zero."""
    values: dict[str, Any] = {}
    unobservable: dict[str, str] = {}
    for probe in REGISTRY:
        try:
            values[probe.name] = probe.observe(runs)
        except Exception as exc:  # e.g. group-relative advantages refuse a batch without trajectory ids
            values[probe.name] = None
            why = " ".join(describe_exception(exc).split())
            unobservable[probe.name] = f"cannot be observed for this batch: {_cut(why)}"
    metrics = runs.faulted.metrics
    for key, value in metrics.items():
        values[f"{METRICS_PREFIX}{key}"] = value
    if metrics:  # BatchRunner finished the batch (a user pipeline gives no metrics)
        for name in probes:
            key = name.removeprefix(METRICS_PREFIX)
            if name.startswith(METRICS_PREFIX) and key not in metrics and is_counter(key):
                values[name] = 0.0
    return Observations(values, unobservable)


def observe(runs: Runs, probes: Iterable[str] = ()) -> dict[str, Any]:
    """The values of :func:`observations`."""
    return observations(runs, probes).values


def _cut(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else f"{text[:limit]}..."
