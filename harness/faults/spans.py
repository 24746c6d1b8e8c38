"""Spans: each env and engine call of a run, logged as it ends, the timeline of each rollout.

A file rather than an in-memory list, so env calls in isolated worker processes and Ray actors land in
the same timeline as in-process ones. Inside an actor every ``reset`` span also logs the actor's node,
which is how the node killer sees, while the batch runs, which node hosts which envs (the probes read
the runner's attempt records instead, which also know the node of an attempt that never got to
``reset``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from harness.jsonlines import append_json_line, read_json_lines

__all__ = ["Span", "SpanKind", "SpanLog", "reset_nodes"]

SpanKind = Literal["generate", "reset", "step", "close"]


def _none_first(value: int | None) -> int:
    return -1 if value is None else value


@dataclass(frozen=True, slots=True)
class Span:
    """One env or engine call as logged: offsets from the run's start; ``end_s`` None if it never ended."""

    kind: SpanKind
    rollout: int | None
    attempt: int | None
    turn: int | None
    start_s: float
    end_s: float | None
    failed: bool
    node: str | None = None
    """The Ray node the call ran on (logged by ``reset`` in a Ray actor); None elsewhere."""


class SpanLog:
    """The calls of a faulted run, appended as JSON lines to ``path``.

    A file rather than an in-memory list, so env calls in isolated worker processes land in the same
    timeline as in-process ones; it is picklable for the same reason. A call that never returns (a
    ``hang``) is logged when it starts, with no end.
    """

    def __init__(self, path: Path, start: float) -> None:
        self.path = Path(path)
        self.start = start

    def record(
        self,
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
        """Log one call; ``started`` and ``ended`` are ``time.time()`` values."""
        span = Span(
            kind=kind,
            rollout=rollout,
            attempt=attempt,
            turn=turn,
            start_s=started - self.start,
            end_s=None if ended is None else ended - self.start,
            failed=failed,
            node=node,
        )
        append_json_line(self.path, dataclasses.asdict(span))

    @contextmanager
    def span(
        self,
        kind: SpanKind,
        *,
        rollout: int | None,
        attempt: int | None,
        turn: int | None,
        node: str | None = None,
    ) -> Iterator[None]:
        """Log the enclosed call, failed if anything (``KeyboardInterrupt`` included) escapes it."""
        started = time.time()
        failed = True
        try:
            yield
            failed = False
        finally:
            ended = time.time()
            where = {"rollout": rollout, "attempt": attempt, "turn": turn}
            self.record(kind, **where, started=started, ended=ended, failed=failed, node=node)

    def read(self) -> list[Span]:
        """Every span logged so far, by any process, in order of start."""
        spans = [Span(**record) for record in read_json_lines(self.path)]
        return sorted(spans, key=lambda s: (s.start_s, _none_first(s.rollout), _none_first(s.turn), s.kind))


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
