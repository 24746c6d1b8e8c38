"""``chaos record`` re-targets network faults at the rollouts their requests named."""

from __future__ import annotations

from typing import Any

from harness.cli import record_scenario
from harness.scenario.spec import Scenario


def firing(
    fault: int, rollout: int | None, attempt: int | None, turn: int | None, detail: str
) -> dict[str, Any]:
    return {
        "fault": fault,
        "kind": "reset_peer",
        "target": "network",
        "rollout": rollout,
        "attempt": attempt,
        "turn": turn,
        "detail": detail,
        "at_s": 1.0,
    }


def test_a_network_fault_that_hit_rollouts_is_recorded_per_rollout_and_one_that_hit_none_as_it_was() -> None:
    spec = {
        "title": "Resets",
        "batch": {"env": "tool_use", "tasks": 8},
        "faults": [
            {"target": "network", "kind": "reset_peer", "link": "tool", "when": {"probability": 0.3}},
            {"target": "network", "kind": "latency", "link": "tool", "when": {"nth_connection": [0]}},
        ],
    }
    journal = {
        "scenarios": [
            {
                "file": "scenarios/x.yaml",
                "title": "Resets",
                "status": "held",
                "spec": spec,
                "firings": [
                    firing(0, 5, 0, 1, "tool POST /calculate: reset"),
                    firing(0, 2, 1, 0, "tool POST /calculate: reset"),
                    firing(1, None, None, None, "tool connection 0: latency 0.05 s"),
                ],
            }
        ]
    }
    recorded = record_scenario(journal)
    assert recorded["faults"] == [
        {
            "target": "network",
            "kind": "reset_peer",
            "link": "tool",
            "when": {"rollouts": [5], "attempts": [0], "turns": [1]},
        },
        {
            "target": "network",
            "kind": "reset_peer",
            "link": "tool",
            "when": {"rollouts": [2], "attempts": [1], "turns": [0]},
        },
        {"target": "network", "kind": "latency", "link": "tool", "when": {"nth_connection": [0]}},
    ]
    Scenario.model_validate(recorded)  # the recorded file is a valid scenario
