"""The judge observes exactly the probes a scenario may name, in the same order."""

from __future__ import annotations

from harness.judge.probes import PROBES
from harness.scenario.probe_names import PROBE_NAMES


def test_every_probe_name_a_scenario_may_use_has_an_observer_in_documentation_order() -> None:
    assert tuple(PROBES) == PROBE_NAMES
