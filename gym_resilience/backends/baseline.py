"""What a reused worker checks after each env: whatever the env left behind that the next env would see.

A worker process or a Ray actor that serves many rollouts builds a new env from the factory for each one,
and after that env's close compares the process with how it was before its first env
(:class:`WorkerBaseline`): processes the env started that are still alive, environment variables, the
working directory, threads still running, signal handlers and blocked signals, interval timers (an alarm
would kill the next env's worker), resource limits and open file descriptors. Any difference retires the
worker (it is killed and replaced, never reused). Memory is not compared and not reset (module globals,
class attributes, caches), nor what C code changes out of Python's sight (``os.putenv``, a C handler,
the umask): the next env of the same worker sees it (``RunnerConfig(env_worker_reuse=False)`` gives each
env a worker of its own).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any

__all__ = ["WorkerBaseline", "become_subreaper", "descendants", "kill_all"]

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Make this process adopt its descendants' orphans (Linux), so a grandchild whose parent exited
    still shows among this process's children. Elsewhere, or refused, only direct children are seen."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)  # this process's own symbols: libc's among them
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _reap_exited_children() -> None:
    """Reap children that have exited (zombies): a child the env waited for is gone already."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _living_children(pid: int | str = "self") -> list[int]:
    """The children of process ``pid`` (this one by default) still running (Linux: every thread's
    ``children`` list under /proc; elsewhere none are seen)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        children = f"/proc/{pid}/task/{task}/children"
        with contextlib.suppress(OSError), open(children, encoding="ascii") as file:
            found += [int(child) for child in file.read().split()]
    return found


def descendants(pid: int | str = "self") -> list[int]:
    """Every process below ``pid`` now, children first: what a worker's env started, including those in
    sessions of their own, which a kill of the worker's process group does not reach."""
    found: list[int] = []
    parents = [pid]
    while parents:
        children = _living_children(parents.pop())
        found += children
        parents += children
    return found


def kill_all(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` that still exists."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _environ() -> Mapping[Any, Any]:
    """The environment variables, undecoded where CPython keeps them so (a cheaper comparison)."""
    data = getattr(os.environ, "_data", None)
    return data if isinstance(data, dict) else os.environ


def _signal_name(signum: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(signum).name
    return f"signal {signum}"


_UNCATCHABLE = {getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name)}
_CATCHABLE = sorted(set(signal.valid_signals()) - _UNCATCHABLE)


def _signal_handlers() -> dict[int, Any]:
    """Python's handler of each signal that can be caught (a handler set by C code is not seen)."""
    handlers: dict[int, Any] = {}
    for signum in _CATCHABLE:
        with contextlib.suppress(ValueError, OSError):
            handlers[signum] = signal.getsignal(signum)
    return handlers


def _blocked_signals() -> set[int]:
    """The signals the calling thread blocks (none where the platform has no signal masks)."""
    return set(signal.pthread_sigmask(signal.SIG_BLOCK, [])) if hasattr(signal, "pthread_sigmask") else set()


_TIMERS = [name for name in ("ITIMER_REAL", "ITIMER_VIRTUAL", "ITIMER_PROF") if hasattr(signal, name)]


def _timers_set() -> set[str]:
    """The interval timers that will fire (``signal.alarm`` sets ``ITIMER_REAL``)."""
    return {name for name in _TIMERS if signal.getitimer(getattr(signal, name)) != (0.0, 0.0)}


_LIMITS: dict[int, str] = {}
"""The resources the platform limits, by number, each with its first name (RLIMIT_OFILE is RLIMIT_NOFILE)."""
if sys.platform != "win32":
    import resource

    for _name in sorted(dir(resource)):
        if _name.startswith("RLIMIT_"):
            _LIMITS.setdefault(getattr(resource, _name), _name)


def _resource_limits() -> dict[int, tuple[int, int]]:
    """The soft and hard limit of every resource the platform limits."""
    limits: dict[int, tuple[int, int]] = {}
    for limit in _LIMITS:
        with contextlib.suppress(ValueError, OSError):
            limits[limit] = resource.getrlimit(limit)
    return limits


_FD_FOLDER = "/proc/self/fd"


def _open_fds() -> frozenset[int] | None:
    """The file descriptors open now (Linux; None elsewhere). The listing's own, closed by the time it
    returns, is left out."""
    try:
        listed = os.listdir(_FD_FOLDER)
    except OSError:
        return None
    return frozenset(fd for fd in map(int, listed) if _is_open(fd))


def _is_open(fd: int) -> bool:
    try:
        os.get_inheritable(fd)
    except OSError:
        return False
    return True


def _describe_fd(fd: int) -> str:
    with contextlib.suppress(OSError):
        return f"{fd} ({os.readlink(os.path.join(_FD_FOLDER, str(fd)))})"
    return str(fd)


class WorkerBaseline:
    """How a worker process was before its first env: what :meth:`changes` compares with. Take it in the
    thread that will call :meth:`changes` (the blocked signals are that thread's). ``open_files=False``
    leaves file descriptors out, for a process whose own runtime opens and closes them as it goes."""

    def __init__(self, *, open_files: bool = True) -> None:
        self._environ = dict(_environ())
        self._cwd = os.getcwd()
        self._threads = frozenset(threading.enumerate())
        self._handlers = _signal_handlers()
        self._blocked = _blocked_signals()
        self._timers = _timers_set()
        self._limits = _resource_limits()
        self._fds = _open_fds() if open_files else None

    def changes(self) -> str | None:
        """What differs now from the baseline, in words (None: nothing that this checks). Children that
        exited are reaped first."""
        _reap_exited_children()
        for check in (
            self._processes,
            self._environment,
            self._directory,
            self._running_threads,
            self._signals,
            self._timers_left,
            self._limits_changed,
            self._files,
        ):
            found = check()
            if found is not None:
                return found
        return None

    def _processes(self) -> str | None:
        children = _living_children()
        if children:
            return f"its env left {len(children)} process(es) running (pids {', '.join(map(str, children))})"
        return None

    def _environment(self) -> str | None:
        environ = _environ()
        if environ == self._environ:
            return None
        changed = sorted(
            str(key)
            for key in self._environ.keys() | environ.keys()
            if self._environ.get(key) != environ.get(key)
        )
        return f"its env changed environment variables: {', '.join(changed)}"

    def _directory(self) -> str | None:
        with contextlib.suppress(OSError):
            if os.getcwd() != self._cwd:
                return f"its env changed the working directory to {os.getcwd()}"
        return None

    def _running_threads(self) -> str | None:
        threads = [thread.name for thread in threading.enumerate() if thread not in self._threads]
        if threads:
            return f"its env left {len(threads)} thread(s) running: {', '.join(threads)}"
        return None

    def _signals(self) -> str | None:
        handlers = _signal_handlers()
        if handlers != self._handlers:
            changed = [_signal_name(s) for s in handlers if handlers[s] != self._handlers.get(s)]
            return f"its env changed the handler of {', '.join(changed)}"
        blocked = _blocked_signals()
        if blocked != self._blocked:
            changed = [_signal_name(s) for s in sorted(blocked ^ self._blocked)]
            return f"its env changed which signals are blocked: {', '.join(changed)}"
        return None

    def _timers_left(self) -> str | None:
        timers = _timers_set() - self._timers
        if timers:
            return f"its env left a timer set (signal.alarm or setitimer): {', '.join(sorted(timers))}"
        return None

    def _limits_changed(self) -> str | None:
        limits = _resource_limits()
        changed = [_LIMITS[limit] for limit in limits if limits[limit] != self._limits.get(limit)]
        if changed:
            return f"its env changed resource limits: {', '.join(changed)}"
        return None

    def _files(self) -> str | None:
        if self._fds is None:
            return None
        fds = _open_fds()
        if fds is None or fds == self._fds:
            return None
        left, closed = sorted(fds - self._fds), sorted(self._fds - fds)
        said = [f"left file descriptor(s) open: {', '.join(map(_describe_fd, left))}"] if left else []
        said += [f"closed file descriptor(s) of its worker: {', '.join(map(str, closed))}"] if closed else []
        return f"its env {' and '.join(said)}"
