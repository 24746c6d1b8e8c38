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
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.spawn
import multiprocessing.util  # before atexit.register below: see _close_workers_at_exit
import os
import pickle
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
from gym_resilience.backends.deadlines import check_seconds
from gym_resilience.backends.process_worker import serve
from gym_resilience.backends.protocol import (
    CLOSE_REQUEST,
    DEFAULT_CLOSE_TIMEOUT_S,
    EnvFn,
    RemoteEnv,
    StartAbort,
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

__all__ = ["IsolatedEnv"]

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

    A call holds ``_call_lock`` and owns the pipes: only its holder sends, receives, and releases the
    handles (closing a file descriptor that another thread waits on is unsafe). ``_state_lock`` guards
    the state and the reaping of the process, which ``close`` may do from another thread while a call
    hangs: it kills the process, and the waiting call wakes up and raises ``EnvClosedError``.
    """

    def __init__(
        self,
        process: BaseProcess,
        conn: Connection[Any, Any],
        lifeline: Connection[Any, Any],
        *,
        close_timeout: float,
    ) -> None:
        self._process = process
        self._sentinel = process.sentinel
        self._conn = conn
        self._lifeline = lifeline
        self._call_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._state = _State.RUNNING
        self._handles_released = False
        self._owner_pid = os.getpid()
        self.close_timeout = close_timeout
        self.pid: int = process.pid or 0
        self.exitcode: int | None = None
        self.env_id: str | None = None
        self.lost: EnvError | None = None
        with _live_workers_lock:
            _live_workers.add(self)

    @property
    def running(self) -> bool:
        return self._state is _State.RUNNING

    def receive_description(self, timeout: float | None, abort: StartAbort | None) -> dict[str, Any]:
        """Waits for the worker's first message: the env's description, or what the factory raised.

        ``abort`` may kill the worker meanwhile, from another thread; the wait then raises EnvClosedError.
        """
        with self._call_lock:
            try:
                if abort is not None:
                    # Under the call lock: a kill from abort() leaves the handles to this thread.
                    abort.watch(self)
                data = self._exchange(None, operation="start", timeout_s=timeout)
            finally:
                if abort is not None:
                    abort.forget()
                self._release_handles_if_ended()
        description: dict[str, Any] = self._unpack(data)
        return description

    def request(self, command: str, payload: Any, *, operation: str, timeout: float | None) -> Any:
        """Runs ``command`` in the worker and returns its value, or raises what the env raised there.

        Raises:
            EnvTimeoutError: no reply within ``timeout`` seconds; the worker was killed.
            EnvWorkerDiedError: the worker died before it replied.
            EnvClosedError: the worker was closed before, or by ``close`` from another thread meanwhile.
        """
        # An action that cannot be pickled fails here, before anything was sent: the worker is fine.
        message = bytes(ForkingPickler.dumps((command, payload)))
        with self._call_lock:
            if self._state is not _State.RUNNING:
                raise EnvClosedError(operation=operation, env_id=self.env_id)
            try:
                data = self._exchange(message, operation=operation, timeout_s=timeout)
            finally:
                # Also when the call succeeded but close() from another thread killed the worker since.
                self._release_handles_if_ended()
        return self._unpack(data)

    def close(self) -> None:
        """Asks the worker to close its env and exit, within ``close_timeout``; else kills it.

        Does nothing if the worker was already closed, killed or lost. The process is reaped on every path.

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
            if self._end(grace_s=0.0):
                raise EnvTimeoutError(operation="close", timeout_s=timeout, env_id=self.env_id)
            return
        try:
            if self._state is not _State.RUNNING:
                return
            data = self._exchange(CLOSE_REQUEST, operation="close", timeout_s=timeout, deadline=deadline)
            # The worker exits right after its reply: let it, within what is left of the deadline.
            self._end(grace_s=max(deadline - time.monotonic(), 0.0))
        finally:
            self._release_handles_if_ended()
            self._call_lock.release()
        self._unpack(data)

    def abandon(self) -> None:
        """Reaps a worker that failed to start (it exits by itself after saying why), killing it if not."""
        with self._call_lock:
            self._end(grace_s=self.close_timeout)
            self._release_handles_if_ended()

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
                ready = multiprocessing.connection.wait([self._conn, self._sentinel], wait_s)
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


def _close_at_collection(worker: _Worker) -> None:
    """Finalizer: closes the worker of an IsolatedEnv that was collected without being closed."""
    if not worker.running:
        return
    try:
        worker.close()
    except Exception as exc:  # nobody is left to raise to
        failure = f"; its close raised {describe_exception(exc)}"
    else:
        failure = ""
    warnings.warn(
        f"unclosed IsolatedEnv (worker pid {worker.pid}) was closed by the garbage collector{failure}",
        ResourceWarning,
        stacklevel=1,
    )


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

    Args:
        env_fn: Picklable zero-argument callable that builds the env.
        step_timeout: Deadline of ``step``, ``render`` and attribute reads, in seconds; None: no limit.
        reset_timeout: Deadline of ``reset``; None: no limit.
        start_timeout: Deadline for the worker to start and ``env_fn`` to return; None: no limit. It
            does not bound the first isolated env's wait for the fork server, which imports the
            program's main module once before its first fork (seconds for a script that imports torch
            or vLLM; a main module whose import hangs hangs that start).
        close_timeout: How long ``close`` waits for the env to close before killing the worker.
        abort: Lets another thread end the start early (see :class:`StartAbort`).

    Raises:
        UnsupportedConfigError: ``env_fn`` cannot be pickled, or a timeout is not a number > 0.
        EnvTimeoutError: the worker did not start within ``start_timeout`` (it was killed).
        EnvWorkerDiedError: the worker died while starting.
        EnvClosedError: ``abort`` was aborted before the env started (the worker was killed).
        Exception: what ``env_fn`` raised in the worker, as itself.
    """

    def __init__(
        self,
        env_fn: EnvFn,
        *,
        step_timeout: float | None = None,
        reset_timeout: float | None = None,
        start_timeout: float | None = None,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT_S,
        abort: StartAbort | None = None,
    ) -> None:
        check_seconds("step_timeout", step_timeout)
        check_seconds("reset_timeout", reset_timeout)
        check_seconds("start_timeout", start_timeout)
        check_seconds("close_timeout", close_timeout, allow_none=False)
        try:
            pickle.dumps(env_fn)
        except Exception as exc:
            raise UnsupportedConfigError(
                "an isolated env is built in a worker process from a picklable factory (a module-level "
                f"function or class, or functools.partial of one), got {env_fn!r}",
                option="env",
            ) from exc
        self.step_timeout = step_timeout
        self.reset_timeout = reset_timeout
        self.close_timeout = close_timeout
        context = _context()
        conn, child_conn = context.Pipe()
        lifeline_reader, lifeline = context.Pipe(duplex=False)
        process = context.Process(  # type: ignore[attr-defined]
            target=serve,
            args=(child_conn, lifeline_reader, env_fn, close_timeout),
            name="gym_resilience-env-worker",
        )
        try:
            process.start()
        finally:
            child_conn.close()
            lifeline_reader.close()
        self._host = self._worker = worker = _Worker(process, conn, lifeline, close_timeout=close_timeout)
        self._finalizer = weakref.finalize(self, _close_at_collection, worker)
        # Interpreter exit is _close_workers_at_exit's job: it runs early enough.
        self._finalizer.atexit = False
        try:
            description = worker.receive_description(start_timeout, abort)
        except BaseException:
            self._finalizer.detach()
            worker.abandon()
            raise
        worker.env_id = self._adopt(description)

    @property
    def pid(self) -> int:
        """The worker process's id."""
        return self._worker.pid

    def close(self) -> None:
        """Closes the env and ends the worker (see :meth:`_Worker.close`); later calls do nothing."""
        self._finalizer.detach()
        self._worker.close()

    def __repr__(self) -> str:
        return f"<IsolatedEnv{getattr(self, '_name', '')} pid={self.pid}>"

    __str__ = __repr__
