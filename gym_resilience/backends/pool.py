"""Warm workers: the one place that decides which worker process or Ray actor an env is built in.

Starting a worker costs far more than a rollout on a cheap env (a process, or a Ray worker), so a
:class:`WorkerPool` keeps workers that served an env and hands them to the next one. Each env is still
new: the worker builds it from the factory, and closes it at the end of its rollout. A worker is reused
only if nothing went wrong: a worker whose env call passed its deadline, that died, whose env failed to
close, or whose env left something behind (see :mod:`~gym_resilience.backends.baseline`) is killed and
replaced. ``reuse=False`` gives every env a worker of its own, killed after its env's close.

The pool never holds more than ``size`` workers alive: :meth:`WorkerPool.take` waits for one to come
back when all are busy. :func:`lease` takes a worker and opens an env on it, and :class:`Lease` is the
env's handle on it (the ``Host`` of :class:`~gym_resilience.backends.protocol.RemoteEnv`), which gives the
worker back once the env is closed. Backends supply the workers (:class:`PooledWorker`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from gym_resilience.backends.protocol import StartAbort, unpack_ending
from gym_resilience.errors import EnvClosedError, EnvError, EnvWorkerDiedError

__all__ = ["EnvTurns", "Lease", "PoolStats", "PooledWorker", "WorkerPool", "lease"]

logger = logging.getLogger(__name__)

POOL_CLOSED = "the env workers were closed (their runner was closed) before this env could start"
"""Why an env that asks a closed pool for a worker does not start (``EnvClosedError.why``)."""


class PooledWorker(Protocol):
    """A worker process or actor that serves envs one after another (one ``generation`` each)."""

    @property
    def lost(self) -> EnvError | None: ...

    @property
    def reusable(self) -> bool:
        """Alive, and its last env closed cleanly and left nothing behind."""
        ...

    @property
    def retired_because(self) -> str | None:
        """Why its last env leaves it unfit to serve another (it left something behind, failed to start
        or close); None while it is fit, and when it died or was killed (its rollout's error says so)."""
        ...

    def serving(self, generation: int) -> bool:
        """Whether env ``generation`` is open on this worker."""
        ...

    def gone(self) -> bool:
        """Whether the worker is known to be dead without asking it (a worker process that exited while
        idle); a Ray actor, which only a call can find dead, says False."""
        ...

    def host_lost(self) -> bool:
        """Whether the worker died of what it ran on (its Ray node died, or it never ran at all): a death
        its env's factory did not cause. A worker process says False."""
        ...

    def request(
        self, command: str, payload: Any, *, operation: str, timeout: float | None, generation: int
    ) -> Any: ...

    def close_env(self, generation: int) -> None:
        """Closes env ``generation`` (a no-op once it is closed or the worker ended)."""
        ...

    def kill(self) -> None: ...


class EnvTurns:
    """A pooled worker's envs, one at a time: which one it serves (its generation), and whether the worker
    may serve another (it may not once an env failed to close or left something behind)."""

    def __init__(self, reuse: bool) -> None:
        self.reuse = reuse
        self.generation = 0
        self.served = 0
        self.open = False
        self.clean = True
        self.retired_because: str | None = None

    def next(self) -> int:
        """Counts the env about to be built; its generation."""
        self.generation += 1
        self.served += 1
        return self.generation

    def judged(self, data: bytes) -> bytes:
        """The reply inside ``data``, a reply to ``open`` or ``close``, whose verdict is judged here; the
        env counts as closed until its description is read (``open = True``)."""
        reply, verdict = unpack_ending(data)
        self.open = False
        if verdict is not None:
            self.clean = False
            self.retired_because = verdict
        return reply

    def opened(self, data: bytes, unpack: Callable[[bytes], Any]) -> dict[str, Any]:
        """The description in ``data``, the reply to ``open`` (``unpack`` raises what the factory raised);
        the env is open once it is read. A failed open retires the worker: an env whose description
        cannot be read here is open there all the same, and a factory that raised may have left state."""
        try:
            description: dict[str, Any] = unpack(self.judged(data))
        except BaseException as exc:
            self.clean = False
            self.retired_because = f"its env failed to start: {exc!r}"
            raise
        self.open = True
        return description

    def failed_to_close(self, error: BaseException) -> None:
        """The env's close raised ``error``: it may have left anything behind, so the worker retires."""
        self.clean = False
        self.retired_because = f"its env failed to close: {error!r}"

    def serving(self, running: bool, generation: int) -> bool:
        return running and self.open and self.generation == generation

    def reusable(self, running: bool) -> bool:
        """Whether the worker may take an env now: one that served none yet (prestarted) may, reuse or not."""
        return (self.reuse or self.served == 0) and self.clean and not self.open and running


W = TypeVar("W", bound=PooledWorker)
T = TypeVar("T")


class PoolStats:
    """What a pool did: workers started and retired, alive now and at most (for tests and benchmarks)."""

    def __init__(self) -> None:
        self.started = 0
        self.retired = 0
        self.most_alive = 0

    @property
    def alive(self) -> int:
        return self.started - self.retired


class _Waker:
    """What a ``StartAbort`` kills while :meth:`WorkerPool.take` waits: the wait."""

    def __init__(self, changed: threading.Condition) -> None:
        self._changed = changed
        self.aborted = False

    def kill(self) -> None:
        with self._changed:
            self.aborted = True
            self._changed.notify_all()


class WorkerPool(Generic[W]):
    """At most ``size`` workers (None: no bound) started by ``start``; idle ones are reused when ``reuse``.

    Thread-safe. After :meth:`close` idle workers are killed and busy ones are killed when given back.
    """

    def __init__(self, start: Callable[[], W], *, size: int | None, reuse: bool = True) -> None:
        self._start = start
        self.size = size
        self.reuse = reuse
        self._changed = threading.Condition()
        self._idle: list[W] = []
        self._alive = 0
        self._closed = False
        self.stats = PoolStats()

    @property
    def closed(self) -> bool:
        return self._closed

    def take(self, abort: StartAbort | None = None) -> tuple[W, bool]:
        """An idle worker, or a new one if fewer than ``size`` are alive; else waits for one to come back.
        Also says whether the worker waited idle (prestarted or reused), as it may have died meanwhile
        unseen. An idle worker found dead is dropped, and counts no more.

        Raises:
            EnvClosedError: ``abort`` was aborted meanwhile, or the pool is closed (its message says
                which).
        """
        waker = _Waker(self._changed)
        dead: list[W] = []
        if abort is not None:
            abort.watch(waker)
        try:
            with self._changed:
                while True:
                    if self._closed:
                        raise EnvClosedError(operation="start", why=POOL_CLOSED)
                    if waker.aborted:
                        raise EnvClosedError(operation="start")
                    if self._idle:
                        worker = self._idle.pop()
                        if not worker.gone():
                            return worker, True
                        dead.append(worker)  # died while idle (killed from outside): replaced
                        self._alive -= 1
                        self.stats.retired += 1
                        continue
                    if self.size is None or self._alive < self.size:
                        self._alive += 1
                        self._count_started()
                        break
                    self._changed.wait()
        finally:
            if abort is not None:
                abort.forget()
            for worker in dead:
                worker.kill()  # reaps it
        try:
            return self._start(), False
        except BaseException:
            self._forget()
            raise

    def give_back(self, worker: W) -> None:
        """Takes back a worker whose env is closed (or that ended): kept idle if it can serve another
        env, else killed; either way a waiting :meth:`take` goes on."""
        with self._changed:
            keep = not self._closed and worker.reusable
            if keep:
                self._idle.append(worker)
                self._changed.notify()
                return
        if (reason := worker.retired_because) is not None:
            # Else silent: the rollout succeeded, and its env's leftovers die with the worker.
            logger.warning("an env worker is retired and killed: %s; the next env gets a fresh one", reason)
        worker.kill()
        self._forget()

    def prestart(self, count: int) -> None:
        """Starts workers until ``count`` (at most ``size``) are alive, idle, ready for envs."""
        started: list[W] = []
        try:
            while True:
                with self._changed:
                    if self._closed or self._alive >= min(count, self.size or count):
                        break
                    self._alive += 1
                    self._count_started()
                try:
                    started.append(self._start())
                except BaseException:
                    self._forget()
                    raise
        finally:
            for worker in started:
                self.give_back(worker)

    def close(self) -> None:
        """Kills the idle workers now, and every busy one when its env closes; later takes fail."""
        with self._changed:
            self._closed = True
            idle, self._idle = self._idle, []
            self._changed.notify_all()
        for worker in idle:
            worker.kill()
            self._forget()

    def _count_started(self) -> None:
        self.stats.started += 1
        self.stats.most_alive = max(self.stats.most_alive, self._alive)

    def _forget(self) -> None:
        with self._changed:
            self._alive -= 1
            self.stats.retired += 1
            self._changed.notify()


class Lease(Generic[W]):
    """One env's hold on a pooled worker: the ``Host`` a remote env calls. Its close closes the env and
    gives the worker back; a call after that raises :class:`EnvClosedError`, never reaching the env the
    worker serves next."""

    def __init__(self, pool: WorkerPool[W], worker: W, generation: int) -> None:
        self._pool = pool
        self.worker = worker
        self._generation = generation
        self._given_back = False
        self._lock = threading.Lock()

    @property
    def lost(self) -> EnvError | None:
        return self.worker.lost

    @property
    def running(self) -> bool:
        return not self._given_back and self.worker.serving(self._generation)

    def request(self, command: str, payload: Any, *, operation: str, timeout: float | None) -> Any:
        return self.worker.request(
            command, payload, operation=operation, timeout=timeout, generation=self._generation
        )

    def close(self) -> None:
        """Closes the env (see the worker's ``close_env``), then gives the worker back; once."""
        if self._given_back:
            return
        try:
            self.worker.close_env(self._generation)
        finally:
            self._give_back()

    def kill(self) -> None:
        """Kills the worker if it still serves this env; safe from any thread."""
        if self.worker.serving(self._generation):
            self.worker.kill()
        self._give_back()

    def _give_back(self) -> None:
        with self._lock:
            if self._given_back:
                return
            self._given_back = True
        self._pool.give_back(self.worker)


def lease(
    pool: WorkerPool[W],
    open_env: Callable[[W, float | None], tuple[int, T]],
    abort: StartAbort | None,
    timeout: float | None,
) -> tuple[Lease[W], T]:
    """Takes a worker from ``pool`` and opens an env on it with ``open_env(worker, seconds left of
    timeout)`` (its generation and what it returned), all within the one ``timeout``. A worker that waited
    idle (prestarted or reused) and dies at the open is replaced: every time if its host is gone (a Ray
    node lost, which may take several idle actors with it), else once, since a second such death is taken
    as the factory's (it crashed its worker), not to be run again. A worker started for this open that
    dies fails it. A failed open retires the worker."""
    deadline = None if timeout is None else time.monotonic() + timeout
    replaced = False  # an idle worker died at the open while its host was up
    tried = False
    while True:
        worker, waited = pool.take(abort)
        # The first open gets the whole timeout (its error names it); a replacement, what is left of it.
        left = timeout if not tried or deadline is None else max(deadline - time.monotonic(), 0.0)
        tried = True
        try:
            generation, opened = open_env(worker, left)
        except EnvWorkerDiedError:
            pool.give_back(worker)
            if waited and (left is None or left > 0):
                host_lost = worker.host_lost()
                if host_lost or not replaced:
                    replaced = replaced or not host_lost
                    continue
            raise
        except BaseException:
            pool.give_back(worker)
            raise
        return Lease(pool, worker, generation), opened
