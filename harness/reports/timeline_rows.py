"""The rows of a scenario's timeline, top to bottom, and what each is labelled: the served endpoints, a
shared row for firings that hit no one rollout or endpoint, and the rollouts, each named with the Ray
node of every attempt. Layout only; ``timeline`` draws them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

from harness.judge.results import Attempt, EndpointSpan, FaultFiring, ScenarioResult

__all__ = [
    "NODE_COLORS",
    "SHARED_ROW",
    "NodeName",
    "Row",
    "RowKey",
    "RowKind",
    "count",
    "endpoint_indices",
    "faulted_end",
    "firing_row_keys",
    "last_moment",
    "node_names",
    "row_layout",
]

NODE_COLORS = ("#1B9E77", "#7570B3", "#E7298A", "#66A61E", "#E6AB02", "#A6761D")
SHARED_ROW = "engine/network"

RowKind = Literal["endpoint", "shared", "rollout"]
RowKey = tuple[RowKind, int | None]


class Row(NamedTuple):
    kind: RowKind
    of: int | None  # the endpoint's or rollout's index; None for the shared row
    label: str
    placeholder: bool = False


def row_layout(result: ScenarioResult) -> list[Row]:
    """The rows top to bottom: the endpoints, the shared row when a firing needs it, the rollouts."""
    endpoints = endpoint_indices(result)
    rows = [
        Row("endpoint", endpoint.index, endpoint_label(endpoint))
        for endpoint in sorted(result.endpoints, key=lambda endpoint: endpoint.index)
    ]
    if any(not firing_row_keys(firing, endpoints) for firing in result.firings):
        rows.append(Row("shared", None, SHARED_ROW))
    placeholder = {rollout.index: rollout.placeholder for rollout in result.rollouts}
    indices = (
        set(placeholder)
        | {rollout.index for rollout in result.baseline_rollouts}
        | {firing.rollout for firing in result.firings if firing.rollout is not None}
    )
    on_nodes = attempt_nodes_by_rollout(result.attempts, node_names(result))
    for index in sorted(indices):
        is_placeholder = placeholder.get(index, False)
        label = f"r{index} placeholder" if is_placeholder else f"r{index}"
        if index in on_nodes:
            label = f"{label} {on_nodes[index]}"
        rows.append(Row("rollout", index, label, is_placeholder))
    return rows


class NodeName(NamedTuple):
    short: str  # in row labels: head, w0, w1, ... (or the id's first characters for a node not listed)
    long: str  # in the legend: head, worker 0 (removed), ...
    color: str


def node_names(result: ScenarioResult) -> dict[str, NodeName]:
    """Each node the scenario's attempts ran on, named after its role in the cluster, colored in turn."""
    names: dict[str, NodeName] = {}
    known = {node.node: node for node in result.nodes}
    used = {attempt.node for attempt in result.attempts if attempt.node is not None}
    used |= {span.node for rollout in result.rollouts for span in rollout.spans if span.node is not None}
    ordered = [node.node for node in result.nodes if node.node in used]
    ordered += sorted(used - set(ordered))
    for number, node in enumerate(ordered):
        color = NODE_COLORS[number % len(NODE_COLORS)]
        listed = known.get(node)
        if listed is None:
            names[node] = NodeName(node[:6], f"node {node[:12]}", color)
            continue
        short = "head" if listed.role == "head" else listed.role.replace("worker ", "w")
        names[node] = NodeName(short, f"{listed.role} (removed)" if listed.removed else listed.role, color)
    return names


def attempt_nodes_by_rollout(attempts: Sequence[Attempt], names: dict[str, NodeName]) -> dict[int, str]:
    """Per rollout, the node of each of its attempts in order (``w0>w1``; ``?`` for one not known)."""
    by_rollout: dict[int, list[Attempt]] = {}
    for attempt in attempts:
        by_rollout.setdefault(attempt.rollout, []).append(attempt)
    labels = {}
    for rollout, tries in by_rollout.items():
        if not any(attempt.node is not None for attempt in tries):
            continue
        tries.sort(key=lambda attempt: attempt.attempt)
        labels[rollout] = ">".join(
            names[attempt.node].short if attempt.node in names else "?" for attempt in tries
        )
    return labels


def endpoint_label(endpoint: EndpointSpan) -> str:
    # Failovers come in bursts (every request in flight when it went down): the count says how many.
    failovers = len(endpoint.failovers_s)
    if not failovers:
        return f"endpoint {endpoint.index}"
    return f"endpoint {endpoint.index} ({count(failovers, 'failover')})"


def endpoint_indices(result: ScenarioResult) -> set[int]:
    return {endpoint.index for endpoint in result.endpoints}


def firing_row_keys(firing: FaultFiring, endpoints: set[int]) -> list[RowKey]:
    """Where a firing's marker goes: its rollout's row and its endpoint's row (each when it has one);
    an empty list means the shared row."""
    keys: list[RowKey] = []
    if firing.rollout is not None:
        keys.append(("rollout", firing.rollout))
    if firing.endpoint is not None and firing.endpoint in endpoints:
        keys.append(("endpoint", firing.endpoint))
    return keys


def last_moment(result: ScenarioResult) -> float:
    """The latest moment anything drawn happened, in either run; 1 s when nothing took time."""
    baseline = [span.end_s for rollout in result.baseline_rollouts for span in rollout.spans]
    last = max([faulted_end(result), *baseline])
    return last if last > 0 else 1.0


def faulted_end(result: ScenarioResult) -> float:
    """The latest moment anything happened in the faulted run."""
    return max(
        [result.faulted_s]
        + [span.end_s for rollout in result.rollouts for span in rollout.spans]
        + [firing.at_s for firing in result.firings]
        + [end for endpoint in result.endpoints for _, end in endpoint.down_s]
        + [at for endpoint in result.endpoints for at in endpoint.failovers_s]
    )


def count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"
