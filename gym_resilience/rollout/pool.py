"""``EnvPool``: the threads that run a batch's env calls and hand each outcome back to the event loop.

A call costs a queue put and an asyncio future, less than ``loop.run_in_executor`` (docs/performance.md),
and outcomes that arrive while the loop is busy are handed over together, in one wake-up. A pool takes a
thread as a call finds none idle, up to ``threads``, and lets each go at :meth:`EnvPool.shutdown` once
every call queued before it has run, so a close queued behind a stuck call still runs when that call
returns. A thread let go waits ``IDLE_S`` for the next batch's pool rather than ending. The threads are
daemons: a stuck call does not hold the interpreter's exit (``ResilientEnv``'s exit hook closes an env
left open then).

An adaptive pool (``eager`` below ``threads``) takes its first ``eager`` threads that way and more only
while its calls block (:class:`CallHistory`): a thread per call for envs that wait on I/O or sleep, so
their calls never queue behind each other, and few threads for fast envs, whose calls a thread runs one
after another with no wake-up between them (a thread per call cost fast envs half again as much a
rollout, docs/performance.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

from gym_resilience.cleanup import settable

__all__ = ["BLOCKED_S", "EAGER_THREADS", "IDLE_S", "CallHistory", "EnvPool", "idle_threads"]

T = TypeVar("T")

IDLE_S = 60.0
"""How long a thread let go by its pool waits for the next one before it ends."""

_IDLE_NAME = "gym-resilience-env-idle"

EAGER_THREADS = 16
"""The threads an adaptive pool takes as calls find none idle, whether or not its calls block."""

BLOCKED_S = 0.002
"""A call blocked (on I/O, a sleep, a lock, a worker process) if it took this much longer in wall time
than in its thread's CPU time."""

_SHARE_WEIGHT = 1 / 16  # how much each call moves CallHistory's share of blocked calls
_BLOCKING_SHARE = 1 / 8  # the share from which calls count as blocking


class CallHistory:
    """Whether recent env calls block: per kind of call (an env's build, its steps, its close), a running
    share of the calls that did (each call moves its kind's share by 1/16), kept across the batches of one
    runner so that a batch's first calls need not teach it again. Calls count as blocking while a kind's
    share is 1/8 or more: a fast env's call that lost the interpreter to another thread once in a while
    does not reach it, an env whose every step waits on a tool does, and a batch's fast builds and closes
    do not wash out what its steps showed. The kinds are fixed (``KINDS``; any other counts as
    ``"call"``), so that pool threads of several batches can update them while another reads them.
    Updated without a lock (a lost update only nudges a share)."""

    KINDS = ("open", "step", "close", "call")

    def __init__(self) -> None:
        self.shares: dict[str, float] = dict.fromkeys(self.KINDS, 0.0)

    @property
    def blocking(self) -> bool:
        return any(share >= _BLOCKING_SHARE for share in self.shares.values())

    def record(self, blocked: bool, kind: str = "call") -> None:
        if kind not in self.shares:
            kind = "call"
        share = self.shares[kind]
        self.shares[kind] = share + (blocked - share) * _SHARE_WEIGHT


# Calls run one after another on one thread, in one context: a future, its call, a future to signal once
# the first is done (or None) and the call's kind (for CallHistory) each.
_Call = tuple["asyncio.Future[Any]", Callable[[], Any], "asyncio.Future[None] | None", str]
_Calls = tuple[contextvars.Context, list[_Call]]
# (future, whether it returned, result or exception, future to signal, whether the call blocked, kind)
_Outcome = tuple["asyncio.Future[Any]", bool, Any, "asyncio.Future[None] | None", bool, str]


class EnvPool:
    """Runs synchronous calls on at most ``threads`` threads, each in the context it was submitted from.

    Like ``loop.run_in_executor``, a call whose future is cancelled before a thread takes it never runs,
    and cancelling the future of a call already running only stops the wait: the thread finishes it.

    With ``eager`` below ``threads``, threads past the first ``eager`` are taken only while ``history``
    says the calls block, for calls waiting in the queue (at once when a blocked call ends).
    """

    def __init__(
        self, threads: int, name: str, *, eager: int | None = None, history: CallHistory | None = None
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._max_threads = threads
        self._eager = threads if eager is None else min(eager, threads)
        self._history = history if history is not None else CallHistory()
        self._name = name
        self._calls: queue.SimpleQueue[_Calls | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the fields below
        self._threads = 0  # taken so far
        self._idle = 0  # threads free for a call not yet taken
        self._waiting = 0  # calls queued with no thread free for them
        self._outcomes: list[_Outcome] = []  # not yet handed to the loop
        self._unreturned: set[asyncio.Future[Any]] = set()  # calls queued or running
        self._after: dict[asyncio.Future[Any], list[_Call]] = {}  # calls to run right after these
        self._waking = False  # a hand-over is scheduled on the loop
        self._shut = False

    def submit(self, call: Callable[[], T], kind: str = "call") -> asyncio.Future[T]:
        """Start ``call`` on a pool thread, in a copy of the caller's context (event loop thread only);
        ``kind`` names what it does for the pool's ``CallHistory`` (``"step"``: an env step)."""
        future: asyncio.Future[T] = self._loop.create_future()
        self._put([(future, call, None, kind)])
        return future

    def submit_signalled(
        self, call: Callable[[], T], kind: str = "call"
    ) -> tuple[asyncio.Future[T], asyncio.Future[None]]:
        """:meth:`submit`, and a second future set to None once the call's is done, to wait on: cancelling
        it (a cancelled task cancels what it awaits) stops the wait and leaves the call's future whole,
        to be awaited through teardown. ``asyncio.shield`` does the same with an extra pass of the event
        loop per call."""
        future: asyncio.Future[T] = self._loop.create_future()
        signal: asyncio.Future[None] = self._loop.create_future()
        self._put([(future, call, signal, kind)])
        return future, signal

    def submit_all(
        self, *calls: Callable[[], Any], kinds: Sequence[str] | None = None
    ) -> list[asyncio.Future[Any]]:
        """Start ``calls`` one after another on one pool thread, each outcome handed over as it comes: one
        hop for several calls (a last step and the close behind it). Each is a call of its own otherwise
        (``kinds``: each one's kind): one whose future is cancelled before it starts does not run, the
        next ones do."""
        futures: list[asyncio.Future[Any]] = [self._loop.create_future() for _ in calls]
        kinds = kinds or ["call"] * len(calls)
        self._put(
            [(future, call, None, kind) for future, call, kind in zip(futures, calls, kinds, strict=True)]
        )
        return futures

    def submit_after(
        self, previous: asyncio.Future[Any], call: Callable[[], T], kind: str = "call"
    ) -> asyncio.Future[T]:
        """:meth:`submit`, but if the call of ``previous`` (a future of this pool's, cancelled or not) is
        still queued or running, ``call`` runs right after it on the same thread, in its context, rather
        than taking a thread of its own to wait on it: a close behind a stuck step holds no second
        thread. Runs even after :meth:`shutdown`, as the calls queued before it do."""
        future: asyncio.Future[T] = self._loop.create_future()
        with self._lock:
            if previous in self._unreturned:
                self._unreturned.add(future)
                self._after.setdefault(previous, []).append((future, call, None, kind))
                return future
        self._put([(future, call, None, kind)])
        return future

    def submit_apart(self, call: Callable[[], T]) -> asyncio.Future[T]:
        """:meth:`submit`, on a new thread of its own rather than a pool thread: for a call that must
        not wait for one (the close that kills an isolated env's worker, while every pool thread may be
        stuck in such envs)."""
        future: asyncio.Future[T] = self._loop.create_future()
        context = contextvars.copy_context()

        def run() -> None:
            self._hand_over(_outcome(future, context, call, None, "apart"), last=False)

        threading.Thread(target=run, name=f"{self._name}-apart", daemon=True).start()
        return future

    def _put(self, calls: list[_Call]) -> None:
        with self._lock:
            if self._shut:
                raise RuntimeError("the env pool is shut down: it takes no more calls")
            self._unreturned.update(future for future, *_ in calls)
            self._calls.put((contextvars.copy_context(), calls))
            if self._idle:
                self._idle -= 1
            else:
                self._waiting += 1
                self._grow()

    def _grow(self) -> None:
        """Take a thread for each call waiting, up to the threads the calls' history allows (lock held)."""
        limit = self._max_threads if self._history.blocking else self._eager
        while self._waiting and self._threads < limit and not self._shut:
            _Worker.take().serve(self, f"{self._name}_{self._threads}")
            self._threads += 1
            self._waiting -= 1

    def shutdown(self) -> None:
        """Let each thread go once the calls queued so far have run; returns at once."""
        with self._lock:
            self._shut = True
            threads = self._threads
        for _ in range(threads):
            self._calls.put(None)

    def work(self) -> None:
        """Run calls on this thread until the pool lets it go (``_Worker`` calls it)."""
        while (item := self._calls.get()) is not None:
            context, calls = item
            index = 0
            while index < len(calls):
                future, call, signal, kind = calls[index]
                index += 1
                # The thread is free for the next call once the last of these is handed over.
                last = index == len(calls)
                calls += self._hand_over(_outcome(future, context, call, signal, kind), last=last)
            del item, calls, future, call, signal, context

    def _hand_over(self, outcome: _Outcome, *, last: bool) -> list[_Call]:
        """Queue ``outcome`` for the loop; returns the calls to run next on this thread (submitted
        after this one), and counts the thread idle if this was its ``last`` call and there are none."""
        with self._lock:
            future, blocked, kind = outcome[0], outcome[4], outcome[5]
            self._unreturned.discard(future)
            after = self._after.pop(future, []) if self._after else []
            if last and not after:  # free: for a call waiting in the queue, if there is one
                if self._waiting:
                    self._waiting -= 1
                else:
                    self._idle += 1
            if kind != "apart":  # on a thread of its own: nothing to tell about the pool's threads
                self._history.record(blocked, kind)
            if blocked and self._waiting:
                self._grow()
            self._outcomes.append(outcome)
            if self._waking:
                return after
            self._waking = True
        # A closed loop raises RuntimeError: nobody is waiting for these outcomes any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._deliver)
        return after

    def _deliver(self) -> None:
        """Settle the outcomes handed over so far. They leave ``_outcomes`` only once settled (settling
        twice changes nothing): a KeyboardInterrupt from a signal handler can stop the loop anywhere in
        here, even before the first line runs, and what it left is found by the next hand-over or by
        :meth:`deliver_pending`."""
        with self._lock:
            self._waking = False
            outcomes = self._outcomes[:]
        for outcome in outcomes:
            _settle(*outcome)
        with self._lock:
            del self._outcomes[: len(outcomes)]  # threads only append; deliveries run on the loop in turn

    def deliver_pending(self) -> None:
        """Settle now, on the event loop, any outcome handed over but not settled yet: for a wait that was
        cancelled, since an interrupt that stopped the loop may have cut the hand-over it waits for."""
        if self._outcomes:
            self._deliver()


def _settle(
    future: asyncio.Future[Any],
    returned: bool,
    value: Any,
    signal: asyncio.Future[None] | None,
    blocked: bool = False,
    kind: str = "call",
) -> None:
    """Hand one outcome to its futures (the signal first: its waiter wakes before what awaits the call);
    settling one twice changes nothing."""
    if signal is not None and not signal.done():
        signal.set_result(None)
    if future.done():  # cancelled: given up on
        return
    if returned:
        future.set_result(value)
    elif value is not None:
        future.set_exception(value)


def _outcome(
    future: asyncio.Future[Any],
    context: contextvars.Context,
    call: Callable[[], Any],
    signal: asyncio.Future[None] | None,
    kind: str,
) -> _Outcome:
    if future.cancelled():  # given up on before it started: it must not run
        return (future, False, None, signal, False, kind)
    wall, cpu = time.perf_counter(), time.thread_time()
    try:
        value, returned = context.run(call), True
    except BaseException as exc:  # handed to the awaiting task, as an executor does
        value, returned = settable(exc, "an env call"), False
    blocked = (time.perf_counter() - wall) - (time.thread_time() - cpu) >= BLOCKED_S
    return (future, returned, value, signal, blocked, kind)


class _Worker:
    """A daemon thread that works for one pool at a time and, between pools, waits among the idle."""

    _idle: ClassVar[list[_Worker]] = []
    _idle_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[tuple[EnvPool, str]] = queue.SimpleQueue()
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

    def serve(self, pool: EnvPool, name: str) -> None:
        self._inbox.put((pool, name))

    def _run(self) -> None:
        thread = self.thread
        while True:
            try:
                pool, thread.name = self._inbox.get(timeout=IDLE_S)
            except queue.Empty:
                with self._idle_lock:
                    if self in self._idle:  # nobody took it meanwhile
                        self._idle.remove(self)
                        return
                continue  # taken just now: its pool is on the way
            pool.work()
            del pool  # an idle thread keeps no pool (nor its event loop) alive
            thread.name = _IDLE_NAME
            with self._idle_lock:
                self._idle.append(self)


os.register_at_fork(after_in_child=_Worker.forget_idle)


def idle_threads() -> frozenset[threading.Thread]:
    """The pool threads waiting for their next pool now (each ends after ``IDLE_S`` without one)."""
    with _Worker._idle_lock:
        return frozenset(worker.thread for worker in _Worker._idle)
