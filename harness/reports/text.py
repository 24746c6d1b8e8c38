"""How every report words a value, a deviation and a fault firing, so the terminal, JUnit and the
timeline say the same thing the same way.
"""

from __future__ import annotations

import json
from typing import Any

from harness.judge.results import FaultFiring, ProbeResult

__all__ = ["deviation_line", "firing_line", "format_value"]


def format_value(value: Any) -> str:
    """An observed value as a report shows it: ``none``, ``true``, ``8``, ``2.417``, ``'EngineDeadError'``.

    Booleans and None are spelled the way ``Probe.describe()`` spells tolerances (``is true``), strings
    keep their quotes as ``== 'x'`` does, and floats get 4 significant digits.
    """
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return repr(value)
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        return repr(value)


def deviation_line(probe: ProbeResult) -> str:
    """``probe placeholders: observed 3, expected <= 1``."""
    line = f"probe {probe.probe}: observed {format_value(probe.observed)}, expected {probe.expected}"
    return f"{line} ({probe.detail})" if probe.detail else line


def firing_line(firing: FaultFiring) -> str:
    """``fault 0 (env raise) at 1.204 s, rollout 2, attempt 0, turn 1: RuntimeError: injected fault``."""
    where = [
        f"{name} {value}"
        for name, value in (("rollout", firing.rollout), ("attempt", firing.attempt), ("turn", firing.turn))
        if value is not None
    ]
    place = ", ".join([f"at {firing.at_s:.3f} s", *where])
    detail = f": {firing.detail}" if firing.detail else ""
    return f"fault {firing.fault} ({firing.target} {firing.kind}) {place}{detail}"
