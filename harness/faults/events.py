"""What the injectors report during a run: fault firings, call spans and envs opened and closed.

Each report goes to a :class:`RunEvents`, the run's recorder (``harness.run.recorder.Recorder``), which
keeps them in memory; an injector that crossed into an env worker process or a Ray actor holds the
recorder's channel instead, so its reports reach the same recording. Inside an actor every ``reset``
span also names the actor's node, which is how the node killer sees, while the batch runs, which node
hosts which envs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import NonNegativeInt

from harness.scenario.kinds import KINDS

__all__ = ["FaultFiring", "RunEvents", "Span", "SpanKind", "record_span", "reset_nodes", "timed_call"]

SpanKind = Literal["generate", "reset", "step", "close"]

Index = NonNegativeInt
"""A fault's position in its scenario, or a rollout, attempt or turn number: never negative (the
journal's strict reading checks it)."""


@dataclass(frozen=True, slots=True)
class FaultFiring:
    """One time a fault hit: which fault (its index in the file), where, and when in the faulted run."""

    fault: Index
    kind: str
    target: str
    rollout: Index | None
    attempt: Index | None
    turn: Index | None
    detail: str
    at_s: float
    endpoint: Index | None = None
    """The served endpoint it hit (a ``kill``'s server, the endpoint behind an engine-link proxy);
    None when it hit no one endpoint."""

    @property
    def failed_call(self) -> bool:
        """Whether the call it hit failed (a delay, a latency or an abort only slow or shorten it)."""
        return KINDS[(self.target, self.kind)].fails_call


@dataclass(frozen=True, slots=True)
class Span:
    """One env or engine call: offsets from the run's start; ``end_s`` None if it never ended."""

    kind: SpanKind
    rollout: int | None
    attempt: int | None
    turn: int | None
    start_s: float
    end_s: float | None
    failed: bool
    node: str | None = None
    """The Ray node the call ran on (logged by ``reset`` in a Ray actor); None elsewhere."""


class RunEvents(Protocol):
    """Where a run's injectors report: the run's recorder, or its channel in another process.

    Picklable: it crosses into env worker processes and Ray actors with the injectors that hold it.
    """

    @property
    def start(self) -> float:
        """``time.time()`` when the run started; every report is an offset from it."""
        ...

    def fired(self, firing: FaultFiring) -> None:
        """A fault hit a call."""

    def called(self, span: Span) -> None:
        """An env or engine call ended (or, for one that never will, started)."""

    def env_opened(self, env_id: str, pid: int) -> None:
        """An env was built, in process ``pid``."""

    def env_closed(self, env_id: str, pid: int) -> None:
        """An env was closed."""


def record_span(
    events: RunEvents,
    kind: SpanKind,
    *,
    rollout: int | None,
    attempt: int | None,
    turn: int | None,
    started: float,
    ended: float | None,
    failed: bool,
    node: str | None = None,
) -> None:
    """Report one call; ``started`` and ``ended`` are ``time.time()`` values (``ended`` None: it never
    returns, a hang or a kill)."""
    events.called(
        Span(
            kind=kind,
            rollout=rollout,
            attempt=attempt,
            turn=turn,
            start_s=started - events.start,
            end_s=None if ended is None else ended - events.start,
            failed=failed,
            node=node,
        )
    )


@contextmanager
def timed_call(
    events: RunEvents | None,
    kind: SpanKind,
    *,
    rollout: int | None,
    attempt: int | None,
    turn: int | None,
    node: str | None = None,
) -> Iterator[None]:
    """Report the enclosed call, failed if anything (``KeyboardInterrupt`` included) escapes it; with no
    ``events``, nothing."""
    if events is None:
        yield
        return
    started = time.time()
    failed = True
    try:
        yield
        failed = False
    finally:
        where = {"rollout": rollout, "attempt": attempt, "turn": turn}
        record_span(events, kind, **where, started=started, ended=time.time(), failed=failed, node=node)


def reset_nodes(spans: Sequence[Any]) -> dict[tuple[int, int], str]:
    """The Ray node each (rollout, attempt) ran on, from the node its ``reset`` span logged; an attempt
    whose env never finished a reset in a Ray actor is left out."""
    return {
        (span.rollout, span.attempt): span.node
        for span in spans
        if span.kind == "reset"
        and span.node is not None
        and span.rollout is not None
        and span.attempt is not None
    }
