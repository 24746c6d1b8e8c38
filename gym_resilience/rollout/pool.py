"""``EnvPool``: the threads that run a batch's env calls and hand each outcome back to the event loop.

A call costs a queue put and an asyncio future. ``loop.run_in_executor`` on a ``ThreadPoolExecutor`` costs
about three times as much per call (a concurrent future with its condition, a semaphore, a second future
chained to it, a loop wake-up per result), and a rollout makes a few env calls per turn. Outcomes that
arrive while the loop is busy are handed over together, in one wake-up.

Threads start as calls find none idle, up to ``threads``, and end at :meth:`EnvPool.shutdown` once every
call queued before it has run: a close still queued behind a stuck call runs when that call returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["EnvPool"]

T = TypeVar("T")

_Call = tuple["asyncio.Future[Any]", contextvars.Context, Callable[[], Any]]
_Outcome = tuple["asyncio.Future[Any]", bool, Any]  # (future, whether it returned, result or exception)


class EnvPool:
    """Runs synchronous calls on at most ``threads`` threads, each in the context it was submitted from.

    Like ``loop.run_in_executor``, a call whose future is cancelled before a thread takes it never runs,
    and cancelling the future of a call already running only stops the wait: the thread finishes it.
    """

    def __init__(self, threads: int, name: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._max_threads = threads
        self._name = name
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # guards the fields below
        self._idle = 0  # threads free for a call not yet taken
        self._outcomes: list[_Outcome] = []  # not yet handed to the loop
        self._waking = False  # a hand-over is scheduled on the loop
        self._shut = False

    def submit(self, call: Callable[[], T]) -> asyncio.Future[T]:
        """Start ``call`` on a pool thread, in a copy of the caller's context (event loop thread only)."""
        future: asyncio.Future[T] = self._loop.create_future()
        with self._lock:
            if self._shut:
                raise RuntimeError("the env pool is shut down: it takes no more calls")
            self._calls.put((future, contextvars.copy_context(), call))
            if self._idle:
                self._idle -= 1
            elif len(self._threads) < self._max_threads:
                self._start_thread()
        return future

    def shutdown(self) -> None:
        """Let each thread end once the calls queued so far have run; returns at once."""
        with self._lock:
            self._shut = True
            threads = len(self._threads)
        for _ in range(threads):
            self._calls.put(None)

    def _start_thread(self) -> None:
        thread = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}")
        self._threads.append(thread)
        thread.start()

    def _work(self) -> None:
        while (item := self._calls.get()) is not None:
            future, context, call = item
            if future.cancelled():  # given up on before it started: it must not run
                outcome: _Outcome = (future, False, None)
            else:
                try:
                    outcome = (future, True, context.run(call))
                except BaseException as exc:  # handed to the awaiting task, as an executor does
                    outcome = (future, False, exc)
            del item, call, context
            self._hand_over(outcome)

    def _hand_over(self, outcome: _Outcome) -> None:
        with self._lock:
            self._idle += 1
            self._outcomes.append(outcome)
            if self._waking:
                return
            self._waking = True
        # A closed loop raises RuntimeError: nobody is waiting for these outcomes any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            outcomes, self._outcomes = self._outcomes, []
            self._waking = False
        for future, returned, value in outcomes:
            if future.cancelled():
                continue
            if returned:
                future.set_result(value)
            elif value is not None:
                future.set_exception(value)
