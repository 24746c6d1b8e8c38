"""When each served endpoint was out of rotation, and when requests failed over from it, for the pictures.

``OpenAIEngine`` keeps counters, not a history, so an ``EndpointWatch`` samples its ``stats`` every
``interval_s`` while a run goes on: an endpoint turning unhealthy opens a stretch out of rotation, turning
healthy again closes it; a rise in its failover count adds that many failovers at the sample's time; a
mark-down and a recovery both seen between two samples is a stretch of no length. Times are offsets
from the run's start, like every span and firing of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EndpointSpan", "EndpointWatch"]


@dataclass(slots=True)
class EndpointSpan:
    """One served vLLM endpoint of the faulted run, by its index in the engine's URL list (its URL is
    left out: the port changes from run to run): when it was out of rotation, and when a request it
    failed moved to another endpoint. Both are measurements, hence ``*_s``."""

    index: int
    down_s: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of each stretch out of rotation; one still out when the run ended ends there."""
    failovers_s: list[float] = field(default_factory=list)
    """When each request it failed was sent to another endpoint."""


class EndpointWatch:
    """Samples ``stats()`` (an ``OpenAIEngine``'s ``stats``) into one ``EndpointSpan`` per endpoint."""

    def __init__(self, stats: Callable[[], Any], start: float, interval_s: float = 0.05) -> None:
        self._stats = stats
        self._start = start
        self._interval_s = interval_s
        first = stats().endpoints
        self.spans = [EndpointSpan(index) for index in range(len(first))]
        self._last = [(e.healthy, e.failovers, e.marked_down, e.recovered) for e in first]
        self._down_since: list[float | None] = [None if e.healthy else 0.0 for e in first]

    def sample(self) -> None:
        now = time.time() - self._start
        for index, endpoint in enumerate(self._stats().endpoints):
            healthy, failovers, marked_down, recovered = self._last[index]
            span = self.spans[index]
            span.failovers_s.extend([now] * (endpoint.failovers - failovers))
            if healthy and not endpoint.healthy:
                self._down_since[index] = now
            elif not healthy and endpoint.healthy:
                span.down_s.append((self._down_since[index] or 0.0, now))
                self._down_since[index] = None
            elif endpoint.healthy and endpoint.marked_down > marked_down and endpoint.recovered > recovered:
                span.down_s.append((now, now))
            self._last[index] = (
                endpoint.healthy,
                endpoint.failovers,
                endpoint.marked_down,
                endpoint.recovered,
            )

    def finish(self) -> list[EndpointSpan]:
        """A last sample; a stretch still open ends now."""
        self.sample()
        now = time.time() - self._start
        for index, since in enumerate(self._down_since):
            if since is not None:
                self.spans[index].down_s.append((since, now))
                self._down_since[index] = None
        return self.spans

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[EndpointWatch]:
        """Sample in the background for the duration of the block."""

        async def loop() -> None:
            while True:
                await asyncio.sleep(self._interval_s)
                self.sample()

        task = asyncio.ensure_future(loop())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
