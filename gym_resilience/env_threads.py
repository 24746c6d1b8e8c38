"""``EnvThreads``: the threads that run a runner's synchronous env calls, kept from batch to batch.

A runner used to make a ``concurrent.futures.ThreadPoolExecutor`` per batch: every batch then started
its threads again, each ``Thread.start`` blocking the event loop until the thread ran, just when the
batch's first requests should reach the engine. Measured on vLLM with 64 single-turn rollouts (about
0.3 s a batch): 7% of the throughput. Here workers outlive a batch and end after ``idle_s`` without
work: back-to-back batches reuse them, and a runner that stops leaves no thread behind for long. A
worker stuck in a hung env is simply busy; ``pending`` tells a runner to take fresh threads instead of
sharing them with it.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, ParamSpec, TypeVar

__all__ = ["IDLE_S", "EnvThreads"]

IDLE_S = 0.5
"""How long a worker waits for work before it ends."""

P = ParamSpec("P")
T = TypeVar("T")

_Call = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class EnvThreads(Executor):
    """At most ``max_threads`` worker threads, started when a call finds none free, ended when idle.

    ``shutdown`` only stops new submissions: queued calls still run (a close queued behind a stuck
    call runs when that call returns), and workers end once idle, so nothing ever waits for a thread.
    """

    def __init__(self, max_threads: int, *, idle_s: float = IDLE_S, name: str = "gym-resilience-env") -> None:
        self._max_threads = max_threads
        self._idle_s = idle_s
        self._name = name
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._pending = 0  # submitted and not finished: queued or running
        self._closed = False
        self._numbers = itertools.count()

    @property
    def pending(self) -> int:
        """Calls submitted and not finished yet (a cancelled call counts until a worker drops it)."""
        return self._pending

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot submit to EnvThreads after shutdown")
            self._pending += 1
            self._calls.put((future, fn, args, kwargs))
            # More calls than workers: none is free for this one.
            start = self._pending > self._threads < self._max_threads
            if start:
                self._threads += 1
        if start:
            self._start_worker()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new calls; queued ones still run (``wait`` and ``cancel_futures`` are not supported:
        a worker stuck in a hung env must never be waited for)."""
        with self._lock:
            self._closed = True

    def _start_worker(self) -> None:
        name = f"{self._name}_{next(self._numbers)}"
        threading.Thread(target=self._work, name=name, daemon=True).start()

    def _work(self) -> None:
        while True:
            try:
                future, fn, args, kwargs = self._calls.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    # More workers than calls: this one is not needed (a call queued just now has one).
                    if self._pending < self._threads:
                        self._threads -= 1
                        return
                continue
            self._run(future, fn, args, kwargs)

    def _run(
        self, future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if not future.set_running_or_notify_cancel():
            with self._lock:
                self._pending -= 1
            return
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            outcome: tuple[bool, Any] = (False, exc)
        else:
            outcome = (True, result)
        # Counted as finished before its result is seen, so a batch that has every result sees 0.
        with self._lock:
            self._pending -= 1
        if outcome[0]:
            future.set_result(outcome[1])
        else:
            future.set_exception(outcome[1])
