"""The worker process of isolated envs: builds each env, then serves the parent's requests to it.

Each worker leads its own process group, so that killing the group ends what the env started (a shell, a
tool server). A second pipe, the lifeline, is never written to: at its end of file (the parent died
without closing the env, even by SIGKILL) the worker exits after a grace period, hung or not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import gymnasium

from gym_resilience.backends.baseline import WorkerBaseline, become_subreaper, descendants, kill_all
from gym_resilience.backends.protocol import answer_ending, answer_open, unpack_ending

__all__ = ["serve"]

_ORPHANED_EXIT_CODE = 70
"""The exit code of a worker that outlived its parent (``EX_SOFTWARE``)."""


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
    kill_all(descendants())  # those in sessions of their own first: the group's kill ends the worker
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


def serve(conn: Connection[Any, Any], lifeline: Connection[Any, Any], grace_s: float, reuse: bool) -> None:
    """The worker's main function: builds an env for each ``open`` request and serves it until its
    ``close``; exits after one env unless ``reuse``, after an env that left something behind, or once
    orphaned."""
    if hasattr(os, "setsid"):
        # A group of its own, which the parent kills whole: the env's subprocesses go with the worker.
        os.setsid()
    # Ctrl-C is the parent's to handle: it decides what happens to its workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(
        target=_exit_when_orphaned, args=(lifeline, grace_s), name="lifeline", daemon=True
    ).start()
    # The orphans of what an env started (a daemon's double fork) stay below the worker, so they end with
    # it even in a session of their own: a reused worker counts them as its env's leftovers (reaping those
    # that exited as it judges each env), a worker of one env ends them as it exits (those that exited
    # meanwhile stay zombies until then, and init reaps them after).
    become_subreaper()
    baseline = WorkerBaseline() if reuse else None
    env: gymnasium.Env[Any, Any] | None = None
    try:
        while True:
            env, reply = answer_open(conn.recv_bytes(), baseline)
            conn.send_bytes(reply)
            if env is not None:
                reply = _serve_env(conn, env, baseline)
                env = None
            if baseline is None or unpack_ending(reply)[1] is not None:
                # One env only, or the env left something behind: the parent kills the group, and the
                # worker what left it.
                kill_all(descendants())
                break
    except (EOFError, OSError):  # the parent went away without a close request
        if env is not None:
            with contextlib.suppress(Exception):
                env.close()
        _end_orphaned_group()
    _exit_now(0)


def _serve_env(
    conn: Connection[Any, Any], env: gymnasium.Env[Any, Any], baseline: WorkerBaseline | None
) -> bytes:
    """Serves ``env`` until its ``close``; returns the reply to that close, already sent."""
    while True:
        reply, closed = answer_ending(env, conn.recv_bytes(), baseline)
        conn.send_bytes(reply)
        if closed:
            return reply
