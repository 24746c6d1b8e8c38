"""Leak accounting for tests: threads, open file descriptors, child processes, and envs created vs closed.

``no_leaks()`` snapshots the process on entry and, on exit, waits (bounded) until everything is back where
it started, then asserts it is. A thread that finishes a call after its rollout gave up, or a worker being
reaped, gets ``settle_s`` to wind down; anything still there after that is a leak.

    counts = EnvCounts()
    with no_leaks(counts) as figures:
        await runner.generate(tasks)
    print(figures)  # before/after counts, for the record

``EnvCounts`` (tests/doubles.py) counts envs built by ``doubles.factory`` in this process (an isolated env's
worker is a child process instead, counted by the child snapshot).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator

import psutil
from doubles import SETTLE_S, EnvCounts
from pool_envs import workers_of

from gym_resilience import BatchRunner
from gym_resilience.rollout.pool import idle_threads


def wait_until(predicate: Callable[[], object], timeout_s: float = SETTLE_S) -> bool:
    """Poll ``predicate`` from this thread until it holds or time is up; whether it holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


async def eventually(predicate: Callable[[], bool], timeout_s: float = SETTLE_S) -> bool:
    """Poll ``predicate`` from the event loop (no helper thread to count) until it holds or time is up."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def worker_processes() -> set[int]:
    """Isolated env workers alive now: grandchildren through the fork server, zombies not counted."""
    return workers_of(os.getpid())


def alive_workers(runner: BatchRunner) -> int:
    """The env workers (processes, actors) of ``runner``'s pool alive now, by its own count."""
    workers = runner.env_workers
    return 0 if workers is None else workers.stats.alive


@dataclasses.dataclass(frozen=True)
class Snapshot:
    threads: frozenset[threading.Thread]
    fds: int
    children: frozenset[int]

    @classmethod
    def now(cls) -> Snapshot:
        me = psutil.Process(os.getpid())
        children = set()
        for child in me.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if child.status() != psutil.STATUS_ZOMBIE:
                    children.add(child.pid)
        # A pool thread waiting for its next pool is kept for reuse, not leaked (busy, it counts).
        alive = frozenset(thread for thread in threading.enumerate() if thread.is_alive()) - idle_threads()
        return cls(threads=alive, fds=me.num_fds(), children=frozenset(children))


@dataclasses.dataclass
class Figures:
    """What ``no_leaks`` measured, printable for the record."""

    before: Snapshot
    after: Snapshot | None = None
    envs: EnvCounts | None = None

    def new_threads(self) -> list[str]:
        assert self.after is not None
        return sorted(thread.name for thread in self.after.threads - self.before.threads)

    def new_children(self) -> list[int]:
        assert self.after is not None
        return sorted(self.after.children - self.before.children)

    def back(self) -> bool:
        assert self.after is not None
        envs = self.envs
        envs_closed = envs is None or (envs.open, envs.building, envs.closed_more_than_once()) == (0, 0, 0)
        return (
            not self.new_threads()
            and not self.new_children()
            and self.after.fds <= self.before.fds
            and envs_closed
        )

    def __str__(self) -> str:
        after = self.after
        lines = [
            f"threads {len(self.before.threads)} -> {'?' if after is None else len(after.threads)}",
            f"open fds {self.before.fds} -> {'?' if after is None else after.fds}",
            f"child processes {len(self.before.children)} -> {'?' if after is None else len(after.children)}",
        ]
        if self.envs is not None:
            lines.append(f"envs created {self.envs.created}, closed {self.envs.closed}")
        return "; ".join(lines)


@contextlib.contextmanager
def no_leaks(envs: EnvCounts | None = None, *, settle_s: float = SETTLE_S) -> Iterator[Figures]:
    """Assert that threads, fds, child processes (and ``envs``) are back to their start values on exit.

    Waits up to ``settle_s`` for them to get there; a body that raised is not checked (its error wins).
    """
    figures = Figures(before=Snapshot.now(), envs=envs)
    yield figures
    deadline = time.monotonic() + settle_s
    while True:
        figures.after = Snapshot.now()
        if figures.back() or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    assert figures.new_threads() == [], f"threads left behind: {figures}"
    assert figures.new_children() == [], f"child processes left behind: {figures}"
    assert figures.after.fds <= figures.before.fds, f"file descriptors left open: {figures}"
    if envs is not None:
        assert (envs.open, envs.building) == (0, 0), f"envs left open: {figures}"
        assert envs.closed_more_than_once() == 0, f"envs closed twice: {figures}"
