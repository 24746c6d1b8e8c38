"""A rollout's env: built, called and closed in the pool, one call at a time, closed on every path.

gymnasium envs are synchronous, so every env call runs in a pool thread. Teardown (an abandoned build, a
close) waits through cancellation for at most the batch's ``close_timeout_s``; a step still running then
is left to its thread, which closes the env when its call returns, and counted in :class:`LateCloses`.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

from gym_resilience.cleanup import wait_through_cancellation
from gym_resilience.env import ResilientEnv
from gym_resilience.errors import describe_exception
from gym_resilience.isolation import StartAbort
from gym_resilience.rollout.progress import Progress
from gym_resilience.worker_env import WorkerEnv

__all__ = ["EnvCalls", "LateCloses", "close_after_failure", "create_env"]

T = TypeVar("T")


@dataclass
class LateCloses:
    """The teardown steps of a batch that it stopped waiting for after ``timeout_s``.

    An env still being built when its rollout gave up, or a close queued behind a call stuck in the
    env's thread: the thread closes the env once that call returns (a build that never returns leaves
    nothing to close). ``count`` says how many, in the batch's metrics and the error it raises.
    """

    timeout_s: float
    count: int = 0

    def left(self, step: asyncio.Future[Any]) -> None:
        self.count += 1

    async def wait(self, step: asyncio.Future[Any]) -> bool:
        """Wait for a teardown step through cancellation, up to ``timeout_s``; whether it finished."""
        return await wait_through_cancellation(step, self.timeout_s, left=self.left)

    def note(self, error: BaseException) -> None:
        """Say on the batch's ``error`` how many envs were left to their threads, if any."""
        if self.count:
            envs = "1 env was" if self.count == 1 else f"{self.count} envs were"
            error.add_note(
                f"{envs} still being built or closed when the batch stopped waiting for them "
                f"(close_timeout_s={self.timeout_s:g}): the thread of each closes it when its call returns"
            )


class EnvCalls:
    """Runs one env's synchronous calls in the pool, one at a time.

    The lock matters on cancellation: the awaiting task stops waiting but the thread finishes its call,
    and ``close`` must not run beside it. An isolated env is the exception: its close is made to run
    beside a stuck call (it kills the worker, which ends that call), so it does not queue behind it.
    """

    def __init__(self, executor: Executor, progress: Progress) -> None:
        self._executor = executor
        self._progress = progress
        self._lock = threading.Lock()

    def _locked(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        with self._lock:
            return fn(*args, **kwargs)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """Start the call in the pool, in the rollout's context; a plain future, so no task is made."""
        return self._start(functools.partial(self._locked, fn, *args, **kwargs))

    def close(self, env: ResilientEnv[Any, Any]) -> asyncio.Future[None]:
        """Start closing ``env``: after its call in flight, or, for an isolated env, beside it."""
        if isinstance(env.unwrapped, WorkerEnv):
            return self._start(env.close)
        return self.submit(env.close)

    def _start(self, call: Callable[[], T]) -> asyncio.Future[T]:
        context = contextvars.copy_context()
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._executor, functools.partial(context.run, call))

    async def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        start = time.perf_counter()
        try:
            return await self.submit(fn, *args, **kwargs)
        finally:
            self._progress.env_s += time.perf_counter() - start


class _Abandoned(Exception):
    """The rollout stopped waiting for its env: the env was closed on arrival, or never built."""


class _EnvBuild:
    """An env built in a pool thread for a rollout that may stop waiting for it meanwhile.

    Whichever side comes last closes the env: the rollout if it got the env, else the thread that
    built it, once it finds the rollout gone. A worker still starting an isolated env is killed at once.
    """

    def __init__(self, make: Callable[[StartAbort], ResilientEnv[Any, Any]]) -> None:
        self._make = make
        self._abort = StartAbort()
        self._lock = threading.Lock()
        self._abandoned = False

    def run(self) -> ResilientEnv[Any, Any]:
        """Build the env (in the pool thread) and hand it over, or close it if the rollout left."""
        if self._abandoned:
            raise _Abandoned
        env = self._make(self._abort)
        with self._lock:
            if not self._abandoned:
                return env
        env.close()
        raise _Abandoned

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
        self._abort.abort()


async def create_env(
    call: EnvCalls, make: Callable[[StartAbort], ResilientEnv[Any, Any]], late: LateCloses
) -> ResilientEnv[Any, Any]:
    """Build the env in its thread; a rollout cancelled meanwhile leaves it to be closed on arrival."""
    build = _EnvBuild(make)
    creating = call.submit(build.run)
    try:
        # Shielded: cancelling the pool's future would lose the env it still hands over.
        return await asyncio.shield(creating)
    except asyncio.CancelledError as cancelled:
        build.abandon()
        if not await late.wait(creating):
            cancelled.add_note(
                f"its env was still being built when the rollout stopped waiting after {late.timeout_s:g} s: "
                "the thread building it closes it when the factory returns"
            )
        elif not creating.cancelled() and creating.exception() is None:
            # Handed over just before the rollout gave up on it.
            await close_after_failure(creating.result(), call, cancelled, late)
        raise


async def close_after_failure(
    env: ResilientEnv[Any, Any], call: EnvCalls, error: BaseException, late: LateCloses
) -> None:
    """Close the env of a failed rollout without masking ``error`` and without waiting forever.

    The close waits for any env call still running in its thread (a cancelled step finishes there);
    past ``late.timeout_s`` it is left to run when that call returns, and ``error`` says so.
    """
    closing = call.close(env)
    if not await late.wait(closing):
        error.add_note(
            f"the env's close is still waiting after {late.timeout_s:g} s for a call stuck in its thread; "
            "it runs when that call returns (isolate_envs=True kills stuck envs instead)"
        )
        return
    try:
        closing.result()
    except Exception as close_error:
        error.add_note(f"closing the env also failed: {describe_exception(close_error)}")
