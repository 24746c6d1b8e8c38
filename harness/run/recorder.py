"""One run's recorder: the fault firings, call spans and envs of a run, handed back in memory.

A :class:`Recorder` is made per run and handed to the injectors (``harness.faults``) and the env ledger
(``harness.run.ledger``), which report to it as things happen. Reports from the harness's own process go
straight into its lists. An injector that crosses into another process (an isolated env's worker, a Ray
actor) is pickled with it, and the recorder pickles as a :class:`Channel`: a writer to a file the
recorder owns, one JSON line per report appended with one ``write`` on an ``O_APPEND`` descriptor (so
lines from every process stay whole); only the recorder reads that file, as reports arrive. What the
run gets back is one :class:`Recording`, whose rollout index is the one the runner gave each call.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from harness.faults.events import FaultFiring, Span

__all__ = ["Channel", "Recorder", "Recording"]


def _none_first(value: int | None) -> int:
    return -1 if value is None else value


def _firing_order(firing: FaultFiring) -> tuple[Any, ...]:
    """By rollout, attempt, turn, fault and detail (unknown coordinates first), then time: two runs of a
    scenario list the same firings in the same order, whatever the scheduling."""
    where = (_none_first(firing.rollout), _none_first(firing.attempt), _none_first(firing.turn))
    return (*where, firing.fault, firing.detail, firing.at_s)


def _span_order(span: Span) -> tuple[Any, ...]:
    return (span.start_s, _none_first(span.rollout), _none_first(span.turn), span.kind)


@dataclass(frozen=True)
class Recording:
    """What one run recorded: every firing (in a scheduling-independent order), every call span (in order
    of start), and how many envs were built and how many were left open.

    A firing's or span's ``rollout`` is the index the runner gave the call (``current_rollout()``, or the
    ``rollout_index`` it passed an isolated env's ``reset``); ``by_rollout`` groups by it.
    """

    firings: list[FaultFiring] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    envs_created: int = 0
    envs_unclosed: int = 0

    def spans_by_rollout(self) -> Mapping[int, list[Span]]:
        """The spans of each rollout, in order of start; calls outside any rollout are left out."""
        grouped: dict[int, list[Span]] = {}
        for span in self.spans:
            if span.rollout is not None:
                grouped.setdefault(span.rollout, []).append(span)
        return grouped

    def firings_of(self, rollout: int) -> list[FaultFiring]:
        """The firings that hit a call of ``rollout``."""
        return [firing for firing in self.firings if firing.rollout == rollout]


@dataclass(frozen=True)
class Channel:
    """A recorder as another process holds it: each report is one JSON line appended to its file."""

    path: Path
    start: float

    def _send(self, record: Mapping[str, Any]) -> None:
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def fired(self, firing: FaultFiring) -> None:
        self._send({"report": "firing", **dataclasses.asdict(firing)})

    def called(self, span: Span) -> None:
        self._send({"report": "span", **dataclasses.asdict(span)})

    def env_opened(self, env_id: str, pid: int) -> None:
        self._send({"report": "env_opened", "id": env_id, "pid": pid})

    def env_closed(self, env_id: str, pid: int) -> None:
        self._send({"report": "env_closed", "id": env_id, "pid": pid})


class Recorder:
    """Records one run: what its injectors and env ledger report, from this process or any other.

    Use it as a context manager around the run (leaving it removes its channel file), hand it (it is a
    ``harness.faults.RunEvents``) to the plan, the injectors and the ledger, and take the
    :meth:`recording` once the run is over.

    Args:
        folder: Where the channel file goes; None: the system's temporary folder.
        start: ``time.time()`` when the run started; every report is an offset from it. None: now.
    """

    def __init__(self, folder: Path | None = None, *, start: float | None = None) -> None:
        self.start = time.time() if start is None else start
        fd, name = tempfile.mkstemp(prefix="gym-resilience-run-", suffix=".jsonl", dir=folder)
        os.close(fd)
        self.channel = Channel(Path(name), self.start)
        self._lock = threading.Lock()
        self._read = 0
        self._partial = b""
        self._firings: list[FaultFiring] = []
        self._spans: list[Span] = []
        self._opened: dict[str, int] = {}
        self._closed: set[str] = set()

    def __reduce__(self) -> tuple[Any, ...]:
        # Another process reports through the channel; only this object reads it.
        return (Channel, (self.channel.path, self.start))

    def __enter__(self) -> Recorder:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Remove the channel file; what was recorded stays readable. Idempotent."""
        self.channel.path.unlink(missing_ok=True)

    # --- Reports (``harness.faults.RunEvents``), from this process. ---------------------------------

    def fired(self, firing: FaultFiring) -> None:
        with self._lock:
            self._firings.append(firing)

    def called(self, span: Span) -> None:
        with self._lock:
            self._spans.append(span)

    def env_opened(self, env_id: str, pid: int) -> None:
        with self._lock:
            self._opened[env_id] = pid

    def env_closed(self, env_id: str, pid: int) -> None:
        with self._lock:
            self._closed.add(env_id)

    # --- Reading. -------------------------------------------------------------------------------------

    def _take_channel(self) -> None:
        """Move the channel's complete new lines into the lists (the caller holds the lock)."""
        try:
            with self.channel.path.open("rb") as stream:
                stream.seek(self._read)
                data = stream.read()
        except FileNotFoundError:
            return
        self._read += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # a line another process is still writing
        for line in lines:
            if not line.strip():
                continue
            record = json.loads(line)
            report = record.pop("report")
            if report == "firing":
                self._firings.append(FaultFiring(**record))
            elif report == "span":
                self._spans.append(Span(**record))
            elif report == "env_opened":
                self._opened[record["id"]] = record["pid"]
            else:
                self._closed.add(record["id"])

    def firings(self) -> list[FaultFiring]:
        """Every firing reported so far, by any process, in a scheduling-independent order."""
        with self._lock:
            self._take_channel()
            return sorted(self._firings, key=_firing_order)

    def spans(self) -> list[Span]:
        """Every span reported so far, by any process, in order of start."""
        with self._lock:
            self._take_channel()
            return sorted(self._spans, key=_span_order)

    def envs_created(self) -> int:
        """How many envs were built so far."""
        with self._lock:
            self._take_channel()
            return len(self._opened)

    def envs_unclosed(self) -> int:
        """Envs built and never closed whose process still runs (a killed worker took its env along)."""
        with self._lock:
            self._take_channel()
            return sum(
                1 for env_id, pid in self._opened.items() if env_id not in self._closed and _alive(pid)
            )

    def recording(self, *, envs_unclosed: int | None = None) -> Recording:
        """Everything recorded so far; ``envs_unclosed`` replaces the count where the caller waited for
        killed processes to go first."""
        return Recording(
            firings=self.firings(),
            spans=self.spans(),
            envs_created=self.envs_created(),
            envs_unclosed=self.envs_unclosed() if envs_unclosed is None else envs_unclosed,
        )


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
