"""Isolated envs: an env in a worker process, so that a deadline can kill it.

A thread that runs ``env.step`` cannot be stopped, so a deadline on it could only stop waiting, not stop
the env. :class:`IsolatedEnv` builds the env in a worker process instead (see
:mod:`~gym_resilience.backends.process_worker`), as Gymnasium's ``AsyncVectorEnv`` does, and kills the
process group when a call runs past its deadline. Requests and replies follow
:mod:`~gym_resilience.backends.protocol` over a pipe; a lock holds each pair together, so threads may
share an env.

Workers start with the ``forkserver`` method where the platform has it (``spawn`` elsewhere): forking a
threaded program is unsafe. The fork server preloads this module and the program's main module once, so a
worker starts without importing them again (timings: docs/performance.md). As with any start method but
``fork``, the factory must be picklable, and a script that creates isolated envs must guard its entry point
with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import functools
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.spawn
import multiprocessing.util  # before atexit.register below: see _close_workers_at_exit
import os
import select
import signal
import threading
import time
import warnings
import weakref
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any

from gym_resilience.backends import _forkserver_main
from gym_resilience.backends.baseline import descendants, kill_all
from gym_resilience.backends.deadlines import check_seconds
from gym_resilience.backends.pool import EnvTurns, Lease, WorkerPool, lease
from gym_resilience.backends.process_worker import serve
from gym_resilience.backends.protocol import (
    CLOSE_REQUEST,
    DEFAULT_CLOSE_TIMEOUT_S,
    EnvFn,
    RemoteEnv,
    StartAbort,
    open_request,
    unpack_reply,
)
from gym_resilience.errors import (
    EnvClosedError,
    EnvError,
    EnvTimeoutError,
    EnvWorkerDiedError,
    UnsupportedConfigError,
    describe_exception,
)

__all__ = ["IsolatedEnv", "ProcessWorkers", "process_workers"]

_DEATH_GRACE_S = 1.0
"""How long a worker whose pipe broke may take to finish exiting, so its own exit code can be read."""


_preload_lock = threading.Lock()
_preload_requested = False


def _context() -> BaseContext:
    """The forkserver context where there is one, asked once to preload this module; else spawn."""
    global _preload_requested
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    with _preload_lock:
        if not _preload_requested:
            _preload_requested = True
            # Keep what the program asked for (by default ``__main__``); the list has no public getter.
            current = getattr(multiprocessing.forkserver._forkserver, "_preload_modules", ["__main__"])
            if __name__ not in current:
                context.set_forkserver_preload([*current, __name__, _forkserver_main.__name__])
                _start_fork_server_with_main()
    return context


def _start_fork_server_with_main() -> None:
    """Start the fork server now, telling it which main module to import once (see ``_forkserver_main``)."""
    data = multiprocessing.spawn.get_preparation_data("forkserver")
    if "init_main_from_path" in data:
        target = f"path:{data['init_main_from_path']}"
    elif "init_main_from_name" in data:
        target = f"name:{data['init_main_from_name']}"
    else:
        return
    os.environ[_forkserver_main.MAIN_VARIABLE] = target
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.pop(_forkserver_main.MAIN_VARIABLE, None)


class _State(enum.Enum):
    RUNNING = "running"
    CLOSED = "closed"


_live_workers: set[_Worker] = set()
# Reentrant: a garbage collection inside the lock may run a finalizer that ends another worker.
_live_workers_lock = threading.RLock()


def _forget_workers_in_forked_child() -> None:
    """A child forked from this process must never close or kill its parent's workers (say, at exit)."""
    global _live_workers_lock
    _live_workers_lock = threading.RLock()  # another thread may have held it at the fork
    _live_workers.clear()


os.register_at_fork(after_in_child=_forget_workers_in_forked_child)


class _Worker:
    """The parent's handle on one worker process: the command pipe, the lifeline, and the state.

    The worker serves one env at a time (``generation`` counts them); a call names its env's generation,
    so a call of an env closed since never reaches the next one. A call holds ``_call_lock`` and owns the
    pipes: only its holder sends, receives, and releases the handles (closing a file descriptor that
    another thread waits on is unsafe). ``_state_lock`` guards the state and the reaping of the process,
    which ``close_env`` or ``kill`` may do from another thread while a call hangs: it kills the process, and
    the waiting call wakes up and raises ``EnvClosedError``.
    """

    def __init__(
        self, process: BaseProcess, conn: Connection[Any, Any], lifeline: Connection[Any, Any], *, reuse: bool
    ) -> None:
        self._process = process
        self._sentinel = process.sentinel
        self._conn = conn
        self._lifeline = lifeline
        self._reuse = reuse
        self.envs = EnvTurns(reuse)
        self._call_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._state = _State.RUNNING
        self._handles_released = False
        self._owner_pid = os.getpid()
        self.close_timeout = DEFAULT_CLOSE_TIMEOUT_S
        self.pid: int = process.pid or 0
        self.exitcode: int | None = None
        self.env_id: str | None = None
        self.lost: EnvError | None = None
        self._fds = ((conn, conn.fileno()), (self._sentinel, self._sentinel))
        self._poller = select.poll() if hasattr(select, "poll") else None
        if self._poller is not None:
            for _, fd in self._fds:
                self._poller.register(fd, select.POLLIN)
        with _live_workers_lock:
            _live_workers.add(self)

    @classmethod
    def start(cls, *, grace_s: float, reuse: bool) -> _Worker:
        """A new worker process, waiting for its first env; ``reuse``: it serves envs until told to stop
        (else it exits after one). ``grace_s``: how long it waits, orphaned, before it kills its group."""
        context = _context()
        conn, child_conn = context.Pipe()
        lifeline_reader, lifeline = context.Pipe(duplex=False)
        process = context.Process(  # type: ignore[attr-defined]
            target=serve,
            args=(child_conn, lifeline_reader, grace_s, reuse),
            name="gym_resilience-env-worker",
        )
        try:
            process.start()
        except BaseException:
            conn.close()
            lifeline.close()
            raise
        finally:
            child_conn.close()
            lifeline_reader.close()
        return cls(process, conn, lifeline, reuse=reuse)

    @property
    def running(self) -> bool:
        return self._state is _State.RUNNING

    @property
    def retired_because(self) -> str | None:
        return self.envs.retired_because

    @property
    def reusable(self) -> bool:
        """Alive, with no env open, and its last env closed cleanly and left nothing behind."""
        return self.envs.reusable(self._state is _State.RUNNING)

    def serving(self, generation: int) -> bool:
        return self.envs.serving(self._state is _State.RUNNING, generation)

    def gone(self) -> bool:
        """Whether the process ended (its sentinel is readable; nothing is read from it)."""
        if self._state is not _State.RUNNING:
            return True
        # poll(), not select(): a program may hold more than 1024 files open.
        return bool(multiprocessing.connection.wait([self._sentinel], timeout=0))

    def host_lost(self) -> bool:
        return False  # a worker process runs here

    def open(
        self, request: bytes, *, timeout: float | None, abort: StartAbort | None, close_timeout: float
    ) -> tuple[int, dict[str, Any]]:
        """Builds an env in the worker from ``request`` (:func:`open_request`): its generation and its
        description, or raises what the factory raised there.

        ``abort`` may kill the worker meanwhile, from another thread; the wait then raises EnvClosedError.
        """
        with self._call_lock:
            generation = self.envs.next()
            self.env_id = None
            self.close_timeout = close_timeout
            try:
                if abort is not None:
                    # Under the call lock: a kill from abort() leaves the handles to this thread.
                    abort.watch(self)
                data = self._exchange(request, operation="start", timeout_s=timeout)
            finally:
                if abort is not None:
                    abort.forget()
                self._release_handles_if_ended()
            description = self.envs.opened(data, self._unpack)
        return generation, description

    def request(
        self, command: str, payload: Any, *, operation: str, timeout: float | None, generation: int
    ) -> Any:
        """Runs ``command`` on env ``generation`` and returns its value, or raises what the env raised.

        Raises:
            EnvTimeoutError: no reply within ``timeout`` seconds; the worker was killed.
            EnvWorkerDiedError: the worker died before it replied.
            EnvClosedError: the env was closed before, or by ``close_env`` from another thread meanwhile.
        """
        # An action that cannot be pickled fails here, before anything was sent: the worker is fine.
        message = bytes(ForkingPickler.dumps((command, payload)))
        with self._call_lock:
            if not self.serving(generation):
                raise EnvClosedError(operation=operation, env_id=self.env_id)
            try:
                data = self._exchange(message, operation=operation, timeout_s=timeout)
            finally:
                # Also when the call succeeded but close_env() from another thread killed the worker since.
                self._release_handles_if_ended()
        return self._unpack(data)

    def close_env(self, generation: int) -> None:
        """Closes env ``generation`` within ``close_timeout``, else kills the worker; a worker that serves
        one env only then exits (it is reaped here). Does nothing if that env was closed already, or the
        worker ended.

        Raises:
            EnvTimeoutError: the env's close, or a call still in flight, outlasted ``close_timeout``.
            EnvWorkerDiedError: the worker died before it replied.
            Exception: what the env's ``close()`` raised in the worker.
        """
        if os.getpid() != self._owner_pid:  # a forked copy: the worker is the parent's to close
            return
        timeout = self.close_timeout
        deadline = time.monotonic() + timeout
        if not self._call_lock.acquire(timeout=timeout):
            # A call is in flight and does not end: kill the worker; that call wakes up with EnvClosedError
            # and releases the handles.
            if self.serving(generation) and self._end(grace_s=0.0):
                raise EnvTimeoutError(operation="close", timeout_s=timeout, env_id=self.env_id)
            return
        try:
            if not self.serving(generation):
                return
            data = self._exchange(CLOSE_REQUEST, operation="close", timeout_s=timeout, deadline=deadline)
            reply = self.envs.judged(data)
            if not self._reuse:  # it exits right after its reply: let it, within what is left
                self._end(grace_s=max(deadline - time.monotonic(), 0.0))
        finally:
            self._release_handles_if_ended()
            self._call_lock.release()
        try:
            self._unpack(reply)
        except BaseException as exc:
            self.envs.failed_to_close(exc)
            raise

    def close(self) -> None:
        """Closes the env it serves, if any (see :meth:`close_env`), and ends the worker."""
        try:
            self.close_env(self.envs.generation)
        finally:
            self.kill()

    def kill(self) -> None:
        """Kills the worker now, whatever it is doing; safe from any thread, a no-op once it ended."""
        if os.getpid() != self._owner_pid:
            return
        self._end(grace_s=0.0)
        if self._call_lock.acquire(blocking=False):
            try:
                self._release_handles_if_ended()
            finally:
                self._call_lock.release()

    def _exchange(
        self,
        message: bytes | None,
        *,
        operation: str,
        timeout_s: float | None,
        deadline: float | None = None,
    ) -> bytes:
        """Sends ``message`` (None: nothing) and returns the reply; the caller holds ``_call_lock``."""
        if deadline is None and timeout_s is not None:
            deadline = time.monotonic() + timeout_s
        try:
            try:
                if message is not None:
                    self._conn.send_bytes(message)
                wait_s = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                ready = self._wait(wait_s)
                if self._conn in ready:
                    return self._conn.recv_bytes()
            except (EOFError, OSError):  # the pipe broke: the worker is gone
                ready = [self._sentinel]
            timed_out = not ready
            # A worker whose pipe broke is exiting: give it a moment, so that its own exit code is read.
            ended_here = self._end(grace_s=0.0 if timed_out else _DEATH_GRACE_S)
        except BaseException:
            # Interrupted while waiting (KeyboardInterrupt): the worker's state is unknown; only killing
            # it is safe.
            self._end(grace_s=0.0)
            raise
        env_id = self.env_id
        error: EnvError
        if not ended_here:  # close() from another thread killed it during this call: "you closed it"
            error = EnvClosedError(operation=operation, env_id=env_id)
        elif timed_out:
            timeout = timeout_s if timeout_s is not None else math.inf
            error = EnvTimeoutError(operation=operation, timeout_s=timeout, env_id=env_id)
        else:
            error = EnvWorkerDiedError(operation=operation, exitcode=self.exitcode, env_id=env_id)
        self.lost = error
        raise error

    def _wait(self, timeout_s: float | None) -> list[Any]:
        """Which of the command pipe and the process's sentinel are ready within ``timeout_s``: one poll
        object per worker where the platform has poll (``connection.wait`` builds a selector per call)."""
        if self._poller is None:
            return multiprocessing.connection.wait([self._conn, self._sentinel], timeout_s)
        timeout_ms = None if timeout_s is None else math.ceil(timeout_s * 1000)
        ready = {fd for fd, _ in self._poller.poll(timeout_ms)}
        return [handle for handle, fd in self._fds if fd in ready]

    def _end(self, *, grace_s: float) -> bool:
        """Marks the worker closed and reaps it, killing it unless it exits within ``grace_s``.

        Returns whether this call ended it (False: it had ended already).
        """
        with self._state_lock:
            ended_here = self._state is _State.RUNNING
            self._state = _State.CLOSED
            process = self._process
            if self.exitcode is None:
                if grace_s > 0:
                    process.join(grace_s)
                if process.exitcode is None:
                    # Listed while the worker still holds them: once it is gone, the ones in sessions of
                    # their own (out of its group) belong to nobody.
                    # Killed while the worker lives: none of them can have been reaped, nor its pid reused.
                    kill_all(descendants(self.pid))
                    _kill_process_group(self.pid)
                    process.kill()  # in case it left its group
                process.join()
                self.exitcode = process.exitcode
                # What the env started and left behind; the group's id is not reused while it has members.
                _kill_process_group(self.pid)
        with _live_workers_lock:
            _live_workers.discard(self)
        return ended_here

    def _release_handles_if_ended(self) -> None:
        """Closes the pipes and the process's handles once it ended; the caller holds ``_call_lock``."""
        if self._state is _State.RUNNING or self._handles_released:
            return
        self._handles_released = True
        self._conn.close()
        self._lifeline.close()
        self._process.close()

    def _unpack(self, data: bytes) -> Any:
        return unpack_reply(data, where=f"the env's worker process (pid {self.pid})", env_id=self.env_id)


def _kill_process_group(pgid: int) -> None:
    if hasattr(os, "killpg"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def _close_workers_at_exit() -> None:
    """Closes every worker still running when the interpreter exits, killing those that do not close.

    Registered after ``multiprocessing.util`` registered its own exit function, so it runs before that
    one (atexit runs last in, first out), which would otherwise wait forever for a worker to exit.
    """
    with _live_workers_lock:
        workers = list(_live_workers)
    try:
        for worker in workers:
            with contextlib.suppress(Exception):  # nobody is left to raise to
                worker.close()
    finally:
        for worker in workers:
            worker.kill()


atexit.register(_close_workers_at_exit)


def _close_at_collection(host: Lease[_Worker]) -> None:
    """Finalizer: closes the env of an IsolatedEnv that was collected without being closed."""
    if not host.running:
        return
    try:
        host.close()
    except Exception as exc:  # nobody is left to raise to
        failure = f"; its close raised {describe_exception(exc)}"
    else:
        failure = ""
    warnings.warn(
        f"unclosed IsolatedEnv (worker pid {host.worker.pid}) was closed by the garbage collector{failure}",
        ResourceWarning,
        stacklevel=1,
    )


ProcessWorkers = WorkerPool[_Worker]
"""A pool of worker processes, each serving isolated envs one after another."""


def process_workers(
    *, size: int | None, reuse: bool, grace_s: float = DEFAULT_CLOSE_TIMEOUT_S
) -> ProcessWorkers:
    """A pool of at most ``size`` worker processes (None: no bound), reused from env to env if ``reuse``.
    ``grace_s``: how long a worker whose parent died waits before it kills its group."""
    return WorkerPool(functools.partial(_Worker.start, grace_s=grace_s, reuse=reuse), size=size, reuse=reuse)


class IsolatedEnv(RemoteEnv):
    """A local stand-in for an env that runs in a worker process, which a deadline kills.

    ``env_fn`` is called once, in the worker, to build the env. Its spaces, ``metadata``,
    ``render_mode`` and ``spec`` are copied here when it starts; ``reset``, ``step``, ``render`` and
    ``close`` run there, as do reads of ``np_random``. This object is its own ``unwrapped``: the real env
    and its wrappers live in the worker, out of reach. ``spec``, when the env has one, re-creates the env
    in-process (a spec cannot carry a factory).

    A call past its deadline kills the worker and raises :class:`EnvTimeoutError`; a worker that dies
    raises :class:`EnvWorkerDiedError`; either way the env is closed. An exception raised by the env is
    raised here as itself, with the worker's traceback as a note, or as :class:`UnpicklableEnvError` if it
    cannot be pickled. Calls from several threads are serialized.

    The env gets a worker process of its own, which ends with its close, unless ``workers`` (a pool from
    :func:`process_workers`) lends it one that served other envs before and serves more after (see
    :mod:`~gym_resilience.backends.pool`).

    Args:
        env_fn: Picklable zero-argument callable that builds the env.
        step_timeout: Deadline of ``step``, ``render`` and attribute reads, in seconds; None: no limit.
        reset_timeout: Deadline of ``reset``; None: no limit.
        start_timeout: Deadline for the env to be built (a worker of its own to start too) and ``env_fn``
            to return; None: no limit. It does not bound the first isolated env's wait for the fork
            server, which imports the program's main module once before its first fork (seconds for a
            script that imports torch or vLLM; a main module whose import hangs hangs that start), nor the
            wait for a pool's worker to come back when all are busy.
        close_timeout: How long ``close`` waits for the env to close before killing the worker.
        abort: Lets another thread end the start early (see :class:`StartAbort`).
        workers: The pool to take a worker from; None: a worker of its own.

    Raises:
        UnsupportedConfigError: ``env_fn`` cannot be pickled, or a timeout is not a number > 0.
        EnvTimeoutError: the env was not built within ``start_timeout`` (its worker was killed).
        EnvWorkerDiedError: the worker died while building the env.
        EnvClosedError: ``abort`` was aborted before the env started (the worker was killed).
        Exception: what ``env_fn`` raised in the worker, as itself.
    """

    _host: Lease[_Worker]

    def __init__(
        self,
        env_fn: EnvFn,
        *,
        step_timeout: float | None = None,
        reset_timeout: float | None = None,
        start_timeout: float | None = None,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT_S,
        abort: StartAbort | None = None,
        workers: ProcessWorkers | None = None,
    ) -> None:
        check_seconds("step_timeout", step_timeout)
        check_seconds("reset_timeout", reset_timeout)
        check_seconds("start_timeout", start_timeout)
        check_seconds("close_timeout", close_timeout, allow_none=False)
        try:
            request = open_request(env_fn)
        except Exception as exc:
            raise UnsupportedConfigError(
                "an isolated env is built in a worker process from a picklable factory (a module-level "
                f"function or class, or functools.partial of one), got {env_fn!r}",
                option="env",
            ) from exc
        self.step_timeout = step_timeout
        self.reset_timeout = reset_timeout
        self.close_timeout = close_timeout
        pool = (
            workers if workers is not None else process_workers(size=None, reuse=False, grace_s=close_timeout)
        )

        def open_env(worker: _Worker, timeout: float | None) -> tuple[int, dict[str, Any]]:
            return worker.open(request, timeout=timeout, abort=abort, close_timeout=close_timeout)

        self._host, description = lease(pool, open_env, abort, start_timeout)
        self._worker = self._host.worker
        self._finalizer = weakref.finalize(self, _close_at_collection, self._host)
        # Interpreter exit is _close_workers_at_exit's job: it runs early enough.
        self._finalizer.atexit = False
        self._worker.env_id = self._adopt(description)

    @property
    def pid(self) -> int:
        """The worker process's id."""
        return self._worker.pid

    def close(self) -> None:
        """Closes the env (see :meth:`_Worker.close_env`) and gives its worker back; later calls do
        nothing."""
        self._finalizer.detach()
        self._host.close()

    def __repr__(self) -> str:
        return f"<IsolatedEnv{getattr(self, '_name', '')} pid={self.pid}>"

    __str__ = __repr__
