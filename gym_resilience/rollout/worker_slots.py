"""``WorkerSlots``: a runner's bound on its rollouts that hold an env worker, shared by its batches.

Every rollout in flight on a worker process or Ray actor holds one of the runner's warm workers. Batches
run at once would otherwise take more workers than the pool has, and their env threads, each blocked
waiting for a worker another batch holds, could wait for each other forever. So each rollout takes a slot
on the event loop before its env is built and gives it back when it ends.
"""

from __future__ import annotations

import asyncio
import threading

from gym_resilience.errors import UnsupportedConfigError

__all__ = ["WorkerSlots"]


class WorkerSlots:
    """A runner's bound on rollouts holding a worker, ``size``: a semaphore its batches share. They share
    it on one event loop at a time (a semaphore serves one loop); a batch started on another loop while
    one runs is refused, as it would otherwise take workers past the bound."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._lock = threading.Lock()  # batches on loops of other threads may start or end meanwhile
        self._loop: asyncio.AbstractEventLoop | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._batches = 0

    def enter(self) -> asyncio.Semaphore:
        """The bound for a batch starting on the running loop (:meth:`leave` once it ended).

        Raises:
            UnsupportedConfigError: a batch of the runner runs on another event loop (``option`` is
                ``"event loop"``).
        """
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._loop is not loop or self._semaphore is None:
                if self._batches:
                    raise UnsupportedConfigError(
                        "a batch of this runner is running on another event loop: its env workers serve "
                        "the batches of one loop at a time; run the batches on one loop (asyncio.gather) "
                        "or give each loop a BatchRunner of its own",
                        option="event loop",
                    )
                self._loop, self._semaphore = loop, asyncio.Semaphore(self._size)
            self._batches += 1
            return self._semaphore

    def leave(self) -> None:
        with self._lock:
            self._batches -= 1
