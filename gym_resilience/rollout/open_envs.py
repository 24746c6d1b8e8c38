"""``OpenEnvs``: the envs a batch built and has not closed yet, closed by the batch if its rollouts cannot.

Each rollout closes its own env on every path its code runs. Two exits leave no rollout code to run: a
``KeyboardInterrupt`` raised by a signal handler inside the event loop's own machinery (a callback lost,
a task never woken), and an event loop that stops with the batch in flight (such an interrupt escaping
``loop.run_until_complete``, which cancels nothing). For those the batch keeps its open envs here: a batch
that ends by an exception closes what is left, and a watchdog thread closes the envs of a batch whose
event loop has stopped running for ``STOPPED_LOOP_S``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import ClassVar

from gym_resilience.errors import describe_exception

__all__ = ["STOPPED_LOOP_S", "OpenEnvs"]

STOPPED_LOOP_S = 0.3
"""How long a batch's event loop may stand still, the batch in flight, before the watchdog closes its envs."""

_WATCH_EVERY_S = 0.1

logger = logging.getLogger("gym_resilience.runner")


class OpenEnvs:
    """The envs of one batch that are open: added as built (with the close that waits for their call in
    flight), removed as their close runs. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closes: dict[int, Callable[[], None]] = {}

    def add(self, env: object, close: Callable[[], None]) -> None:
        with self._lock:
            self._closes[id(env)] = close

    def discard(self, env: object) -> None:
        with self._lock:
            self._closes.pop(id(env), None)

    def __len__(self) -> int:
        return len(self._closes)

    def close_all(self) -> int:
        """Close every env still here, each on a daemon thread of its own (a close waits for the env's call
        in flight, which may never return); returns how many. A close already running elsewhere is a
        no-op: an env closes once."""
        with self._lock:
            closes, self._closes = list(self._closes.values()), {}
        for close in closes:
            threading.Thread(
                target=_close_quietly, args=(close,), name="gym-resilience-close", daemon=True
            ).start()
        return len(closes)

    def watch(self, loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
        """Have the watchdog close these envs if ``loop`` stops running for ``STOPPED_LOOP_S``; returns the
        call that ends the watch (the batch ended)."""
        return _Watchdog.watch(self, loop)


def _close_quietly(close: Callable[[], None]) -> None:
    try:
        close()
    except Exception as exc:  # nobody is left to raise to: the batch is gone
        logger.warning("closing an env its interrupted batch left open failed: %s", describe_exception(exc))


class _Watchdog:
    """One daemon thread for every batch in flight, while there is one; it checks each batch's loop."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _batches: ClassVar[dict[int, tuple[OpenEnvs, asyncio.AbstractEventLoop, list[float | None]]]] = {}
    _thread: ClassVar[threading.Thread | None] = None

    @classmethod
    def watch(cls, envs: OpenEnvs, loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
        key = id(envs)
        with cls._lock:
            cls._batches[key] = (envs, loop, [None])
            if cls._thread is None:
                cls._thread = threading.Thread(target=cls._run, name="gym-resilience-watchdog", daemon=True)
                cls._thread.start()

        def unwatch() -> None:
            with cls._lock:
                cls._batches.pop(key, None)

        return unwatch

    @classmethod
    def _run(cls) -> None:
        while True:
            time.sleep(_WATCH_EVERY_S)
            now = time.monotonic()
            stopped: list[OpenEnvs] = []
            with cls._lock:
                if not cls._batches:
                    cls._thread = None
                    return
                for key, (envs, loop, since) in list(cls._batches.items()):
                    if loop.is_running():
                        since[0] = None
                    elif since[0] is None:
                        since[0] = now
                    elif now - since[0] >= STOPPED_LOOP_S:
                        del cls._batches[key]
                        stopped.append(envs)
            for envs in stopped:
                count = envs.close_all()
                if count:
                    logger.warning(
                        "a batch's event loop stopped with the batch in flight (a KeyboardInterrupt that "
                        "escaped loop.run_until_complete?): its %d open env(s) are being closed",
                        count,
                    )
