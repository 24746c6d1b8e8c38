"""Isolated envs: an env in a worker process, so that a deadline can kill it.

A thread that runs ``env.step`` cannot be stopped, so a deadline on it could only stop waiting, not stop the
env. :class:`IsolatedEnv` builds the env in a worker process instead, as Gymnasium's ``AsyncVectorEnv``
does, and kills the process when a call runs past its deadline. ``ResilientEnv(env_fn, isolate=True, ...)``
wraps one; use it directly only if you want the raw exceptions instead of the typed errors.

The pipe protocol is one request, then one reply, strictly alternating; a lock holds the pair together, so
threads may share an env. Requests are ``(command, payload)``:

- ``("reset", {"seed": ..., "options": ...})``: ``env.reset(seed=..., options=...)``;
- ``("step", action)``: ``env.step(action)``;
- ``("render", None)``: ``env.render()``;
- ``("getattr", (name, on_unwrapped))``: ``getattr(env.unwrapped if on_unwrapped else env, name)``;
- ``("setattr", (name, value, on_unwrapped))``: the same for ``setattr``;
- ``("close", None)``: ``env.close()``; the worker exits after its reply.

Replies are ``("ok", value)`` or ``("raised", pickled exception or None, type name, str, traceback, why it
did not pickle)``. The worker's first message, once the factory built the env, is the reply
``("ok", description)`` (spaces, metadata, render mode, spec, name) or ``("raised", ...)``.

Each worker leads its own process group, and ending a worker kills that group: the subprocesses the env
started (a shell, a tool server) die with it instead of outliving a killed worker.

A second pipe, the lifeline, is never written to: the worker watches it, and when it reads end of file
(the parent died without closing the env, even by SIGKILL) it exits after a grace period, hung or not.

Workers start with the ``forkserver`` method where the platform has it (``spawn`` elsewhere): forking a
threaded program (the batch runner uses threads and asyncio) is unsafe. This module asks the fork server
to preload it, and with it gym_resilience and gymnasium, so that a worker starts in 30-45 ms instead of
300-450 ms of imports each time (measured on a busy two-core machine; the fork server itself starts once,
in 1-2 s); that takes effect only if nothing in the program started the fork server before the first
isolated env. Closing a worker takes a few milliseconds, a call a pipe round trip (about 0.1 ms).

As with any start method but ``fork``, the factory must be picklable (a module-level function or class, or
``functools.partial`` of one, not a lambda), and a script that creates isolated envs must guard its entry
point with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import abc
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
import pickle
import reprlib
import signal
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any, NoReturn, SupportsFloat

import gymnasium
import numpy as np
from gymnasium.core import RenderFrame

from gym_resilience import _forkserver_main
from gym_resilience.deadlines import check_seconds
from gym_resilience.errors import (
    EnvClosedError,
    EnvError,
    EnvTimeoutError,
    EnvWorkerDiedError,
    UnpicklableEnvError,
    UnsupportedConfigError,
    describe_exception,
    exception_message,
)
from gym_resilience.worker_env import Killable, WorkerEnv

__all__ = ["DEFAULT_CLOSE_TIMEOUT_S", "EnvFn", "IsolatedEnv", "RemoteEnv", "StartAbort", "checked_env"]

DEFAULT_CLOSE_TIMEOUT_S = 5.0
"""How long ``close()`` waits for an isolated env to close before killing its worker."""

EnvFn = Callable[[], gymnasium.Env[Any, Any]]
"""A picklable zero-argument callable that builds the env, called once in the worker."""

_ORPHANED_EXIT_CODE = 70
"""The exit code of a worker that outlived its parent (``EX_SOFTWARE``)."""

_DEATH_GRACE_S = 1.0
"""How long a worker whose pipe broke may take to finish exiting, so its own exit code can be read."""


# --- the worker process ------------------------------------------------------------------------------


def _type_name(error: BaseException) -> str:
    cls = type(error)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _raised_reply(error: BaseException) -> tuple[Any, ...]:
    text = "".join(traceback.format_exception(error))
    blob: bytes | None = None
    reason = ""
    try:
        pickled = pickle.dumps(error)
        # A custom __init__ pickles fine and fails only when unpickled: find out here, not in the parent.
        pickle.loads(pickled)
        blob = pickled
    except Exception as exc:
        reason = describe_exception(exc)
    # A broken __str__ must not hide the error it belongs to: exception_message never raises.
    return ("raised", blob, _type_name(error), exception_message(error), text, reason)


def _describe(env: gymnasium.Env[Any, Any]) -> dict[str, Any]:
    spec = env.spec
    try:
        pickle.dumps(spec)
    except Exception:  # kwargs the parent could not receive (a lambda): it simply has no spec
        spec = None
    return {
        "observation_space": env.observation_space,
        "action_space": env.action_space,
        "metadata": env.metadata,
        "render_mode": env.render_mode,
        "spec": spec,
        "name": str(env),
    }


def _run(env: gymnasium.Env[Any, Any], command: str, payload: Any) -> Any:
    if command == "step":
        return env.step(payload)
    if command == "reset":
        return env.reset(**payload)
    if command == "render":
        return env.render()
    if command == "close":
        return env.close()
    if command == "getattr":
        name, on_unwrapped = payload
        return getattr(env.unwrapped if on_unwrapped else env, name)
    if command == "setattr":
        name, value, on_unwrapped = payload
        return setattr(env.unwrapped if on_unwrapped else env, name, value)
    raise ValueError(f"unknown command {command!r}")


def _exit_when_orphaned(lifeline: Connection[Any, Any], grace_s: float) -> None:
    """Ends the worker once its parent is gone, even while the env hangs (a daemon thread)."""
    # The parent never writes to the lifeline: this returns only at end of file, when the parent closed it
    # or died.
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv_bytes()
    # An idle worker reads the command pipe's end of file too and closes its env meanwhile.
    time.sleep(grace_s)
    _end_orphaned_group()


def _end_orphaned_group() -> None:
    """End this worker and what its env started: nobody else will, with the parent gone (its ``_end``
    kills the group otherwise)."""
    if hasattr(os, "killpg"):
        with contextlib.suppress(OSError):
            os.killpg(0, signal.SIGKILL)  # the worker leads its group (setsid): it goes too
    os._exit(_ORPHANED_EXIT_CODE)


def _exit_now(code: int) -> NoReturn:
    """Exit at once, output flushed: an interpreter's normal exit waits for the env's non-daemon threads
    (a server thread, an executor's), which would hold every close until the parent's kill."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


_value_repr = reprlib.Repr()
_value_repr.maxstring = _value_repr.maxother = 80


def _qualified_name(named: object) -> str:
    """``module.qualname`` of a class or function (``qualname`` alone for a builtin); the main script is
    ``__main__`` in a worker process too (where multiprocessing imports it as ``__mp_main__``)."""
    module = getattr(named, "__module__", None)
    if module == "__mp_main__":
        module = "__main__"
    name = getattr(named, "__qualname__", None) or getattr(named, "__name__", "?")
    return str(name) if module in (None, "builtins") else f"{module}.{name}"


def _factory_name(factory: object) -> str:
    """The factory's qualified name, the same in every process: a partial's function (a backend that
    builds the env elsewhere binds the task with one), a callable object's type."""
    while isinstance(factory, functools.partial):
        factory = factory.func
    try:
        if isinstance(factory, type) or isinstance(getattr(factory, "__qualname__", None), str):
            return _qualified_name(factory)
    except Exception:  # a hostile __getattr__
        pass
    return f"{_qualified_name(type(factory))} object"


def _describe_value(value: object) -> str:
    """What a factory returned instead of an env, and what was expected."""
    if value is None:
        return "None, expected a gymnasium.Env"
    if isinstance(value, type):
        instance = " (an instance of it)" if issubclass(value, gymnasium.Env) else ""
        return f"the class {_qualified_name(value)}, expected a gymnasium.Env{instance}"
    try:
        shown = _value_repr.repr(value)
    except Exception:  # reprlib survives most broken reprs, not all
        shown = "<unprintable>"
    return f"{shown} (of type {_qualified_name(type(value))}), expected a gymnasium.Env"


def checked_env(value: object, factory: object) -> gymnasium.Env[Any, Any]:
    """``value``, what ``factory`` returned, if it is an env: the one check of every backend's envs.

    Raises:
        TypeError: ``value`` is no ``gymnasium.Env``; the message names ``factory`` and ``value``. A
            ``value`` with a ``close()`` (not a class) was closed first; a failure of that close is a note.
    """
    if isinstance(value, gymnasium.Env):
        return value
    error = TypeError(f"env factory {_factory_name(factory)} returned {_describe_value(value)}")
    if not isinstance(value, type):  # a class's close is a function that wants an instance
        try:
            close = getattr(value, "close", None)
            if callable(close):
                close()
        except Exception as close_error:
            error.add_note(
                f"closing what the env factory returned also failed: {describe_exception(close_error)}"
            )
    raise error


def build_env(env_fn: EnvFn) -> tuple[gymnasium.Env[Any, Any] | None, bytes]:
    """Builds the env where it will live: the env and the ``("ok", description)`` reply, or None and the
    ``("raised", ...)`` reply saying what ``env_fn`` raised, or that it returned no env (see
    :func:`checked_env`; an env it built is closed when describing it fails)."""
    env: gymnasium.Env[Any, Any] | None = None
    try:
        env = checked_env(env_fn(), env_fn)
        return env, bytes(ForkingPickler.dumps(("ok", _describe(env))))
    except BaseException as exc:
        if env is not None:
            with contextlib.suppress(Exception):
                env.close()
        return None, bytes(ForkingPickler.dumps(_raised_reply(exc)))


def answer_request(env: gymnasium.Env[Any, Any], data: bytes) -> tuple[bytes, str]:
    """Runs one pickled request on ``env``: the pickled reply, and the command (``close`` ends the host)."""
    command = ""
    try:
        command, payload = pickle.loads(data)
        value = _run(env, command, payload)
    except BaseException as exc:  # KeyboardInterrupt too: the parent re-raises it, as in-process
        return bytes(ForkingPickler.dumps(_raised_reply(exc))), command
    try:
        return bytes(ForkingPickler.dumps(("ok", value))), command
    except Exception as exc:  # the value does not pickle: that is the call's failure
        return bytes(ForkingPickler.dumps(_raised_reply(exc))), command


def _serve(conn: Connection[Any, Any], lifeline: Connection[Any, Any], env_fn: EnvFn, grace_s: float) -> None:
    """The worker's main function: builds the env, then serves requests until ``close`` or orphaned."""
    if hasattr(os, "setsid"):
        # A group of its own, which the parent kills whole: the env's subprocesses go with the worker.
        os.setsid()
    # Ctrl-C is the parent's to handle: it decides what happens to its workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(
        target=_exit_when_orphaned, args=(lifeline, grace_s), name="lifeline", daemon=True
    ).start()
    env, ready = build_env(env_fn)
    try:
        conn.send_bytes(ready)
        while env is not None and _serve_one(conn, env):
            pass
    except (EOFError, OSError):  # the parent went away without a close request
        if env is not None:
            with contextlib.suppress(Exception):
                env.close()
        _end_orphaned_group()
    _exit_now(0)  # closed, or its build failed and was reported


def _serve_one(conn: Connection[Any, Any], env: gymnasium.Env[Any, Any]) -> bool:
    """Serves one request; returns whether to go on (False after ``close``)."""
    reply, command = answer_request(env, conn.recv_bytes())
    conn.send_bytes(reply)
    return command != "close"


# --- the parent process ------------------------------------------------------------------------------

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


def unpack_reply(data: bytes, *, where: str, env_id: str | None) -> Any:
    """The value of an ``ok`` reply from ``where`` (the env's host); raises the exception of a ``raised``
    reply, as itself with the host's traceback as a note, or as :class:`UnpicklableEnvError`."""
    try:
        reply = pickle.loads(data)
    except Exception as exc:
        exc.add_note(f"while unpickling the reply of {where}")
        raise
    if reply[0] == "ok":
        return reply[1]
    _, blob, type_name, message, text, reason = reply
    error: BaseException | None = None
    if blob is not None:
        try:
            error = pickle.loads(blob)
        except Exception as exc:  # its class is not importable here
            reason = describe_exception(exc)
    if not isinstance(error, BaseException):
        error = UnpicklableEnvError(type_name=type_name, message=message, reason=reason, env_id=env_id)
    error.add_note(f"raised in {where}:\n{text.rstrip()}")
    raise error


CLOSE_REQUEST = bytes(ForkingPickler.dumps(("close", None)))
"""The pickled ``close`` request."""


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


class StartAbort:
    """Lets another thread give up on an env still starting: :meth:`abort` kills its worker or actor.

    Pass one to ``IsolatedEnv(..., abort=...)`` or ``RayEnv(..., abort=...)``. Aborted before or while the
    env is built, the start raises :class:`EnvClosedError` and leaves no process or actor behind; once the
    env has started, ``abort()`` no longer touches it. A thread cannot be stopped, a process or an actor
    can: this is how a caller that stops waiting for an env (a cancelled rollout) makes sure it never
    arrives.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._aborted = False
        self._starting: Killable | None = None

    def abort(self) -> None:
        """Kills what is still starting, and anything that starts under this later."""
        with self._lock:
            self._aborted = True
            if self._starting is not None:
                self._starting.kill()

    def watch(self, starting: Killable) -> None:
        """Called by the env while it starts: ``abort()`` kills ``starting`` from now on (at once if it was
        aborted already)."""
        with self._lock:
            if self._aborted:
                starting.kill()
            else:
                self._starting = starting

    def forget(self) -> None:
        """Called by the env once its start ended, either way: ``abort()`` no longer touches it."""
        with self._lock:
            self._starting = None


class RemoteEnv(WorkerEnv):
    """The local surface of an env that lives elsewhere (a worker process, a Ray actor).

    Subclasses say how a request reaches the env (:meth:`_request`); this class turns the Gymnasium API
    into requests and copies the env's description (spaces, ``metadata``, ``render_mode``, ``spec``) when
    it starts. It is its own ``unwrapped``: the real env and its wrappers are out of reach.
    """

    step_timeout: float | None
    reset_timeout: float | None
    _name: str

    @abc.abstractmethod
    def _request(self, command: str, payload: Any, *, operation: str, timeout: float | None) -> Any:
        """Runs ``command`` on the env and returns its value, or raises what the env raised."""

    def _adopt(self, description: dict[str, Any]) -> str | None:
        """Copies the env's description here; returns its id (its spec's), if any."""
        self.observation_space = description["observation_space"]
        self.action_space = description["action_space"]
        self.metadata = description["metadata"]
        self.render_mode = description["render_mode"]
        self.spec = description["spec"]
        self._name = description["name"]
        return self.spec.id if self.spec is not None else None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Resets the env, within ``reset_timeout``."""
        result: tuple[Any, dict[str, Any]] = self._request(
            "reset", {"seed": seed, "options": options}, operation="reset", timeout=self.reset_timeout
        )
        return result

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        """Steps the env, within ``step_timeout``."""
        result: tuple[Any, SupportsFloat, bool, bool, dict[str, Any]] = self._request(
            "step", action, operation="step", timeout=self.step_timeout
        )
        return result

    def render(self) -> RenderFrame | list[RenderFrame] | None:
        """Renders the env, within ``step_timeout``."""
        frame: RenderFrame | list[RenderFrame] | None = self._request(
            "render", None, operation="render", timeout=self.step_timeout
        )
        return frame

    def _remote_attr(self, name: str, *, on_unwrapped: bool = False) -> Any:
        return self._request(
            "getattr", (name, on_unwrapped), operation=f"read {name}", timeout=self.step_timeout
        )

    def _set_remote_attr(self, name: str, value: Any, *, on_unwrapped: bool = False) -> None:
        self._request(
            "setattr", (name, value, on_unwrapped), operation=f"set {name}", timeout=self.step_timeout
        )

    @property
    def np_random(self) -> np.random.Generator:
        """The env's random generator, read from where it lives (a copy: setting it sends one there)."""
        generator: np.random.Generator = self._remote_attr("np_random")
        return generator

    @np_random.setter
    def np_random(self, value: np.random.Generator) -> None:
        self._set_remote_attr("np_random", value)

    @property
    def np_random_seed(self) -> int:
        """The seed of the env's random generator, read from where it lives."""
        seed: int = self._remote_attr("np_random_seed")
        return seed

    # check_env reads the private generator of ``unwrapped``, which for a remote env is this object.
    @property
    def _np_random(self) -> np.random.Generator | None:
        generator: np.random.Generator | None = self._remote_attr("_np_random", on_unwrapped=True)
        return generator

    @_np_random.setter
    def _np_random(self, value: np.random.Generator | None) -> None:
        self._set_remote_attr("_np_random", value, on_unwrapped=True)


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
            target=_serve,
            args=(child_conn, lifeline_reader, env_fn, close_timeout),
            name="gym_resilience-env-worker",
        )
        try:
            process.start()
        finally:
            child_conn.close()
            lifeline_reader.close()
        self._worker = worker = _Worker(process, conn, lifeline, close_timeout=close_timeout)
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

    @property
    def lost(self) -> EnvError | None:
        """The error that ended the worker (a timeout, its death, a close during a call), else None."""
        return self._worker.lost

    @property
    def closed(self) -> bool:
        """Whether the worker was closed, killed or lost."""
        return not self._worker.running

    def _request(self, command: str, payload: Any, *, operation: str, timeout: float | None) -> Any:
        return self._worker.request(command, payload, operation=operation, timeout=timeout)

    def close(self) -> None:
        """Closes the env and ends the worker (see :meth:`_Worker.close`); later calls do nothing."""
        self._finalizer.detach()
        self._worker.close()

    def __repr__(self) -> str:
        return f"<IsolatedEnv{getattr(self, '_name', '')} pid={self.pid}>"

    __str__ = __repr__
