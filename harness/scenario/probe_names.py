"""The names a scenario's probes may take: ``harness.judge.probes`` observes each of them.

The scenario models accept exactly these names (and ``metrics.<key>``); the judge's registry holds
what each one observes, in the same order (a test checks that the two agree).
"""

from __future__ import annotations

from typing import Final

__all__ = ["METRICS_PREFIX", "PROBE_NAMES", "is_probe"]

METRICS_PREFIX: Final = "metrics."
"""``metrics.<key>`` reads the runner metric ``<key>`` of the faulted run."""

PROBE_NAMES: Final[tuple[str, ...]] = (
    "batch_size",
    "validator_passes",
    "failed",
    "placeholders",
    "placeholder_rollouts",
    "envs_unclosed",
    "identical_to_baseline",
    "numerical_ties",
    "error_type",
    "wall_time_ratio",
    "wall_over_injected_latency",
    "retries",
    "retries_succeeded",
    "retries_moved_node",
    "nodes_used",
    "envs_on_head_node",
    "actors_left_alive",
    "failovers",
    "faults_fired",
    "masked_groups",
    "token_level_rewards",
    "logprobs_per_token",
)
"""Every probe's name, in the order the documentation lists them."""


def is_probe(name: str) -> bool:
    """Whether a scenario may name ``name``: a registered probe, or ``metrics.<key>``."""
    return name in PROBE_NAMES or (name.startswith(METRICS_PREFIX) and name != METRICS_PREFIX)
