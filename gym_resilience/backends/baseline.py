"""What a reused worker checks after each env: whatever the env left behind that the next env would see.

A worker process or a Ray actor that serves many rollouts builds a new env from the factory for each one,
and after that env's close compares the process with how it was before its first env
(:class:`WorkerBaseline`): processes the env started that are still alive, environment variables, the
working directory, threads still running. Any difference retires the worker (it is killed and replaced,
never reused). Module globals, class attributes and caches are not compared and not reset: an env that
changes them is seen by the next env of the same worker (``RunnerConfig(env_worker_reuse=False)`` gives
each env a worker of its own).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
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


class WorkerBaseline:
    """How a worker process was before its first env: what :meth:`changes` compares with."""

    def __init__(self) -> None:
        self._environ = dict(_environ())
        self._cwd = os.getcwd()
        self._threads = frozenset(threading.enumerate())

    def changes(self) -> str | None:
        """What differs now from the baseline, in words (None: nothing that this checks). Children that
        exited are reaped first."""
        _reap_exited_children()
        children = _living_children()
        if children:
            return f"its env left {len(children)} process(es) running (pids {', '.join(map(str, children))})"
        environ = _environ()
        if environ != self._environ:
            changed = sorted(
                str(key)
                for key in self._environ.keys() | environ.keys()
                if self._environ.get(key) != environ.get(key)
            )
            return f"its env changed environment variables: {', '.join(changed)}"
        with contextlib.suppress(OSError):
            if os.getcwd() != self._cwd:
                return f"its env changed the working directory to {os.getcwd()}"
        threads = [thread.name for thread in threading.enumerate() if thread not in self._threads]
        if threads:
            return f"its env left {len(threads)} thread(s) running: {', '.join(threads)}"
        return None
