"""EndpointWatch turns OpenAIEngine's counters into stretches out of rotation and failover times."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from harness.run.endpoints import EndpointWatch


@dataclass(frozen=True)
class Endpoint:
    healthy: bool = True
    failovers: int = 0
    marked_down: int = 0
    recovered: int = 0


@dataclass
class Stats:
    endpoints: tuple[Endpoint, ...]


def test_a_stretch_out_of_rotation_and_failovers_are_recorded_per_endpoint() -> None:
    stats = Stats((Endpoint(), Endpoint()))
    watch = EndpointWatch(lambda: stats, start=time.time())
    stats.endpoints = (Endpoint(healthy=False, failovers=2, marked_down=1), Endpoint())
    watch.sample()
    stats.endpoints = (Endpoint(healthy=True, failovers=2, marked_down=1, recovered=1), Endpoint())
    watch.sample()
    first, second = watch.finish()
    assert len(first.down_s) == 1 and first.down_s[0][0] <= first.down_s[0][1]
    assert len(first.failovers_s) == 2
    assert (second.down_s, second.failovers_s) == ([], [])


def test_a_flap_between_samples_is_a_stretch_of_no_length_and_an_open_stretch_ends_at_finish() -> None:
    stats = Stats((Endpoint(), Endpoint()))
    watch = EndpointWatch(lambda: stats, start=time.time())
    stats.endpoints = (Endpoint(marked_down=1, recovered=1), Endpoint(healthy=False, marked_down=1))
    watch.sample()
    stats.endpoints = (replace(stats.endpoints[0]), stats.endpoints[1])
    first, second = watch.finish()
    assert len(first.down_s) == 1 and first.down_s[0][0] == first.down_s[0][1]
    assert len(second.down_s) == 1 and second.down_s[0][0] <= second.down_s[0][1]
