"""``EnvPool``: the threads that run a batch's env calls and hand each outcome back to the event loop.

A call costs a queue put and an asyncio future. ``loop.run_in_executor`` on a ``ThreadPoolExecutor`` costs
about three times as much per call (a concurrent future with its condition, a semaphore, a second future
chained to it, a loop wake-up per result), and a rollout makes a few env calls per turn. Outcomes that
arrive while the loop is busy are handed over together, in one wake-up.

A pool takes a thread as a call finds none idle, up to ``threads``, and lets each go at
:meth:`EnvPool.shutdown` once every call queued before it has run: a close still queued behind a stuck call
runs when that call returns. A thread let go waits for the next pool (a batch's pool takes it rather than
starting one: starting 16 threads cost a 64-rollout batch about 5 ms of its 10, the event loop's and the
engine's time) and ends after ``IDLE_S`` without one. The threads are daemons: a call stuck in an env does
not hold the interpreter's exit (an env left open then is closed by ``ResilientEnv``'s exit hook).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

__all__ = ["BASE_THREADS", "GROW_AFTER_S", "IDLE_S", "EnvPool", "idle_threads"]

T = TypeVar("T")

IDLE_S = 60.0
"""How long a thread let go by its pool waits for the next one before it ends."""
BASE_THREADS = 16
"""The threads a pool takes for calls as they come; more only for slow calls (``GROW_AFTER_S``)."""
GROW_AFTER_S = 0.01
"""How long a call must have run before the calls waiting behind it get threads of their own: two of
the interpreter's switch intervals, so that a fast call waiting for the GIL does not count as slow."""

_IDLE_NAME = "gym-resilience-env-idle"

# Calls run one after another on one thread, in one context: a future and its call each.
_Calls = tuple[contextvars.Context, list[tuple["asyncio.Future[Any]", Callable[[], Any]]]]
_Outcome = tuple["asyncio.Future[Any]", bool, Any]  # (future, whether it returned, result or exception)


class EnvPool:
    """Runs synchronous calls on at most ``threads`` threads, each in the context it was submitted from.

    Like ``loop.run_in_executor``, a call whose future is cancelled before a thread takes it never runs,
    and cancelling the future of a call already running only stops the wait: the thread finishes it.

    The pool starts with ``BASE_THREADS`` and takes more only for slow calls: when a call has waited
    ``GROW_AFTER_S`` behind a thread busy that long or longer, it takes a thread for every call waiting
    (up to ``threads``). Fast calls (an env built or stepped in microseconds) stay on few threads, which
    contend less for the GIL with the event loop and an in-process engine; slow ones (a tool call, a
    sandbox starting, a hung env) get a thread each within ``GROW_AFTER_S``.
    """

    def __init__(self, threads: int, name: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._max_threads = threads
        self._name = name
        self._calls: queue.SimpleQueue[_Calls | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the fields below
        self._busy_since: list[float | None] = []  # per thread taken: when its call started, None idle
        self._idle = 0  # threads free for a call not yet taken
        self._waiting = 0  # calls queued that no thread is free for yet
        self._growing: asyncio.TimerHandle | None = None  # a check for slow calls is scheduled
        self._outcomes: list[_Outcome] = []  # not yet handed to the loop
        self._waking = False  # a hand-over is scheduled on the loop
        self._shut = False

    def submit(self, call: Callable[[], T]) -> asyncio.Future[T]:
        """Start ``call`` on a pool thread, in a copy of the caller's context (event loop thread only)."""
        (future,) = self.submit_all(call)
        return future

    def submit_all(self, *calls: Callable[[], Any]) -> list[asyncio.Future[Any]]:
        """Start ``calls`` one after another on one pool thread, each outcome handed over as it comes:
        one hop for several calls (a last step and the close behind it). Each is a call of its own
        otherwise: one whose future is cancelled before it starts does not run, the next ones do."""
        futures: list[asyncio.Future[Any]] = [self._loop.create_future() for _ in calls]
        with self._lock:
            if self._shut:
                raise RuntimeError("the env pool is shut down: it takes no more calls")
            self._calls.put((contextvars.copy_context(), list(zip(futures, calls, strict=True))))
            if self._idle:
                self._idle -= 1
            elif len(self._busy_since) < min(BASE_THREADS, self._max_threads):
                self._take_threads(1)
            else:
                self._waiting += 1
                if self._growing is None and len(self._busy_since) < self._max_threads:
                    self._growing = self._loop.call_later(GROW_AFTER_S, self._grow)
        return futures

    def _grow(self) -> None:
        """A thread for every call waiting, if a call has run ``GROW_AFTER_S`` or longer; checked again
        after as long while calls wait and more threads may be taken."""
        with self._lock:
            self._growing = None
            if self._shut or not self._waiting:
                return
            slow_since = time.monotonic() - GROW_AFTER_S
            if any(started is not None and started <= slow_since for started in self._busy_since):
                added = min(self._waiting, self._max_threads - len(self._busy_since))
                self._take_threads(added)
                self._waiting -= added
            if self._waiting and len(self._busy_since) < self._max_threads:
                self._growing = self._loop.call_later(GROW_AFTER_S, self._grow)

    def _take_threads(self, count: int) -> None:
        for _ in range(count):
            slot = len(self._busy_since)
            self._busy_since.append(None)
            _Worker.take().serve(self, slot, f"{self._name}_{slot}")

    def shutdown(self) -> None:
        """Let each thread go once the calls queued so far have run; returns at once."""
        with self._lock:
            self._shut = True
            threads = len(self._busy_since)
            if self._growing is not None:
                self._growing.cancel()
                self._growing = None
        for _ in range(threads):
            self._calls.put(None)

    def work(self, slot: int) -> None:
        """Run calls on this thread (the pool's ``slot``) until the pool lets it go (``_Worker`` calls it)."""
        busy_since = self._busy_since
        while (item := self._calls.get()) is not None:
            context, calls = item
            busy_since[slot] = time.monotonic()  # a list slot of its own: no lock needed
            for index, (future, call) in enumerate(calls, start=1):
                outcome = _outcome(future, context, call)
                last = index == len(calls)
                if last:
                    busy_since[slot] = None
                # The thread is free for the next call once the last of these is handed over.
                self._hand_over(outcome, free=last)
            del item, calls, future, call, context, outcome

    def _hand_over(self, outcome: _Outcome, *, free: bool) -> None:
        with self._lock:
            if free:
                if self._waiting:  # this thread takes one of them next
                    self._waiting -= 1
                else:
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


def _outcome(future: asyncio.Future[Any], context: contextvars.Context, call: Callable[[], Any]) -> _Outcome:
    if future.cancelled():  # given up on before it started: it must not run
        return (future, False, None)
    try:
        return (future, True, context.run(call))
    except BaseException as exc:  # handed to the awaiting task, as an executor does
        return (future, False, exc)


class _Worker:
    """A daemon thread that works for one pool at a time and, between pools, waits among the idle."""

    _idle: ClassVar[list[_Worker]] = []
    _idle_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[tuple[EnvPool, int, str]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=_IDLE_NAME, daemon=True)
        self.thread.start()

    @classmethod
    def take(cls) -> _Worker:
        """An idle worker, or a new one."""
        with cls._idle_lock:
            if cls._idle:
                return cls._idle.pop()
        return cls()

    @classmethod
    def forget_idle(cls) -> None:
        """In a forked child: the parent's threads do not exist here."""
        cls._idle = []
        cls._idle_lock = threading.Lock()

    def serve(self, pool: EnvPool, slot: int, name: str) -> None:
        self._inbox.put((pool, slot, name))

    def _run(self) -> None:
        thread = self.thread
        while True:
            try:
                pool, slot, thread.name = self._inbox.get(timeout=IDLE_S)
            except queue.Empty:
                with self._idle_lock:
                    if self in self._idle:  # nobody took it meanwhile
                        self._idle.remove(self)
                        return
                continue  # taken just now: its pool is on the way
            pool.work(slot)
            del pool  # an idle thread keeps no pool (nor its event loop) alive
            thread.name = _IDLE_NAME
            with self._idle_lock:
                self._idle.append(self)


os.register_at_fork(after_in_child=_Worker.forget_idle)


def idle_threads() -> frozenset[threading.Thread]:
    """The pool threads waiting for their next pool now (each ends after ``IDLE_S`` without one)."""
    with _Worker._idle_lock:
        return frozenset(worker.thread for worker in _Worker._idle)
