"""A rollout's env: built, called and closed in the pool, one call at a time, closed on every path.

gymnasium envs are synchronous, so every env call runs in a pool thread. Teardown (an abandoned build, a
close) waits through cancellation for at most the batch's ``close_timeout_s``; a step still running then
is left to its thread, which closes the env when its call returns, and counted in :class:`LateCloses`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from gym_resilience.backends.choice import BackendEnv
from gym_resilience.backends.protocol import StartAbort
from gym_resilience.backends.resilient import ResilientEnv
from gym_resilience.cleanup import wait_through_cancellation
from gym_resilience.errors import describe_exception, root_cause
from gym_resilience.rollout.open_envs import OpenEnvs
from gym_resilience.rollout.pool import EnvPool
from gym_resilience.rollout.progress import Progress

__all__ = [
    "KILL_GRACE_S",
    "EnvCalls",
    "LateCloses",
    "Outcome",
    "close_after_failure",
    "open_env",
]

T = TypeVar("T")

KILL_GRACE_S = 5.0
"""How long teardown waits, past ``close_timeout_s``, for the close of an isolated env: killing its worker
at that deadline and reaping it takes a moment (more on a loaded machine, or for a Ray actor)."""


@dataclass
class LateCloses:
    """The teardown steps of a batch that it stopped waiting for after ``timeout_s``.

    An env still being built when its rollout gave up, or a close queued behind a call stuck in the
    env's thread: the thread closes the env once that call returns (a build that never returns leaves
    nothing to close). ``count`` says how many, in the batch's metrics and the error it raises.
    """

    timeout_s: float
    nudge: Callable[[], None] | None = None
    """Redelivers the outcomes the env pool holds, on a cancellation (see ``EnvPool.deliver_pending``)."""
    count: int = 0

    def left(self, step: asyncio.Future[Any]) -> None:
        self.count += 1

    async def wait(self, step: asyncio.Future[Any]) -> bool:
        """Wait for a teardown step through cancellation, up to ``timeout_s``; whether it finished."""
        return await self._wait(step, self.timeout_s)

    async def wait_to_end(self, step: asyncio.Future[Any]) -> None:
        """Wait for a teardown step through cancellation, however long it takes."""
        await self._wait(step, None)

    async def _wait(self, step: asyncio.Future[Any], timeout_s: float | None) -> bool:
        return await wait_through_cancellation(step, timeout_s, left=self.left, nudge=self.nudge)

    async def wait_close(self, env: BackendEnv, closing: asyncio.Future[None]) -> bool:
        """:meth:`wait` for ``env``'s close. A remote env's gets ``KILL_GRACE_S`` more: its close itself
        kills the worker at ``timeout_s``, then reaps it, so it ends on time of its own."""
        grace_s = KILL_GRACE_S if env.remote else 0.0
        return await self._wait(closing, self.timeout_s + grace_s)

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

    def __init__(self, pool: EnvPool, progress: Progress, open_envs: OpenEnvs) -> None:
        self._pool = pool
        self._progress = progress
        self._open_envs = open_envs
        self._lock = threading.Lock()
        self._last: asyncio.Future[Any] | None = None  # the last call started
        self._closing: asyncio.Future[None] | None = None
        self._closing_apart = False  # the close runs on a thread of its own (it can kill a stuck worker)
        self._last_step_returned: threading.Event | None = None  # a remote env's, its close queued behind
        self.env: BackendEnv | None = None  # the env, once its rollout has it

    def _locked(self, fn: Callable[..., T], *args: Any) -> Callable[[], T]:
        return _Locked(self._lock, fn, args)

    def submit(self, fn: Callable[..., T], *args: Any, kind: str = "call") -> asyncio.Future[T]:
        """Start the call in the pool, in the rollout's context; a plain future, so no task is made.
        ``kind`` names what it does (``EnvPool.submit``)."""
        self._last = self._pool.submit(self._locked(fn, *args), kind)
        return self._last

    def submit_signalled(
        self, fn: Callable[..., T], *args: Any, kind: str = "call"
    ) -> tuple[asyncio.Future[T], asyncio.Future[None]]:
        """:meth:`submit`, with a future to wait on that is signalled once the call's is done (see
        :meth:`EnvPool.submit_signalled`)."""
        self._last, signal = self._pool.submit_signalled(self._locked(fn, *args), kind)
        return self._last, signal

    def opened(self, env: BackendEnv) -> None:
        """Count ``env`` among the batch's open envs (in the thread that built it), with the close that
        the batch runs should the rollout be unable to (see :class:`OpenEnvs`)."""
        close = self._closer(env.env)
        self._open_envs.add(env.env, close if env.remote else self._locked(close))

    def _closer(self, env: ResilientEnv[Any, Any]) -> Callable[[], None]:
        """``env.close``, after which the env no longer counts as open."""
        return _CloseAndForget(env, self._open_envs)

    def close(self, env: BackendEnv) -> asyncio.Future[None]:
        """Start closing ``env`` (once: a close already queued is returned). It runs after the call in
        flight, on that call's thread (it takes no second one to wait there); an isolated env's close
        runs beside that call instead, on a thread of its own, since it must kill a stuck worker even
        when every pool thread is stuck (also when a close queued behind its last step waits there)."""
        returned = self._last_step_returned
        stuck = returned is not None and not returned.is_set()  # the close queued behind it waits too
        if self._closing is None or (stuck and not self._closing_apart):
            close = self._closer(env.env)
            if env.remote:
                self._closing_apart = True
                self._closing = self._pool.submit_apart(close)
            elif self._last is None:
                self._closing = self.submit(close, kind="close")
            else:
                self._closing = self._pool.submit_after(self._last, self._locked(close), "close")
        return self._closing

    def __call__(self, fn: Callable[..., T], *args: Any, kind: str = "call") -> Coroutine[Any, Any, T]:
        """``fn(*args)`` in the pool, timed as the rollout's env time (await it)."""
        return self.timed(self.submit(fn, *args, kind=kind))

    def last_step(self, env: BackendEnv, action: Any) -> asyncio.Future[Any]:
        """Start ``env.step(action)`` with the env's close queued behind it in the same hop (the rollout
        ends whatever the step does); ``close`` then returns that close, or, for an isolated env whose
        step is stuck, starts one beside it that kills the worker."""
        close = self._closer(env.env)
        if env.remote:
            self._last_step_returned = returned = threading.Event()

            def step_and_say() -> Any:
                try:
                    return env.env.step(action)
                finally:
                    returned.set()

            step_now, close_after = self._locked(step_and_say), close
        else:
            step_now, close_after = self._locked(env.env.step, action), self._locked(close)
        step, self._closing = self._pool.submit_all(step_now, close_after, kinds=("step", "close"))
        self._last = step
        return step

    async def timed(self, call: asyncio.Future[T]) -> T:
        """Await a call started here, its time counted as the rollout's env time."""
        start = time.perf_counter()
        try:
            result = await call
        finally:
            self._progress.env_s += time.perf_counter() - start
        self.returned(call)
        return result

    def returned(self, call: asyncio.Future[Any]) -> None:
        """The call of ``call`` returned and its outcome was taken: a close has nothing to queue behind,
        and the future (with what it returned: an env's first observation, say) is not kept meanwhile."""
        if self._last is call:
            self._last = None


class _Locked(Generic[T]):
    """``fn(*args)`` under ``lock``. An object rather than a closure: a rollout keeps a few of these
    alive while it waits for its generation, and one object is less for the garbage collector to scan
    than a function with its cells."""

    __slots__ = ("_args", "_fn", "_lock")

    def __init__(self, lock: threading.Lock, fn: Callable[..., T], args: tuple[Any, ...]) -> None:
        self._lock, self._fn, self._args = lock, fn, args

    def __call__(self) -> T:
        with self._lock:
            return self._fn(*self._args)


class _CloseAndForget:
    """``env.close()``, after which ``env`` no longer counts among the batch's open envs."""

    __slots__ = ("_env", "_open_envs")

    def __init__(self, env: ResilientEnv[Any, Any], open_envs: OpenEnvs) -> None:
        self._env, self._open_envs = env, open_envs

    def __call__(self) -> None:
        try:
            self._env.close()
        finally:
            self._open_envs.discard(self._env)


class _Abandoned(Exception):
    """The rollout stopped waiting for its env: the env was closed on arrival, or never built."""


Reset = Callable[[ResilientEnv[Any, Any]], tuple[Any, dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a call made in a pool thread ended, for the rollout to act on: its value or its exception."""

    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


def _timed(fn: Callable[[], T]) -> Outcome:
    start = time.perf_counter()
    try:
        value = fn()
    except BaseException as exc:  # the rollout raises it, and closes the env, as for any env call
        return Outcome(error=exc, seconds=time.perf_counter() - start)
    return Outcome(value=value, seconds=time.perf_counter() - start)


class _EnvBuild:
    """An env built (and reset) in a pool thread for a rollout that may stop waiting for it meanwhile.

    Whichever side comes last closes the env: the rollout if the thread handed the env over before the
    rollout left (even if the hand-over reaches the event loop later), else the thread that built it,
    once it finds the rollout gone. A worker still starting an isolated env is killed at once.
    """

    def __init__(self, call: EnvCalls, make: Callable[[StartAbort], BackendEnv], reset: Reset) -> None:
        self._call = call
        self._make = make
        self._reset = reset
        self._abort = StartAbort()
        self._lock = threading.Lock()
        self._abandoned = False
        self._handed = False

    def run(self) -> tuple[BackendEnv, Outcome | None]:
        """Build the env and reset it (in the pool thread), and hand both over, or close the env if the
        rollout left. A rollout that gives up during an isolated env's reset kills its worker, as while
        it starts."""
        if self._abandoned:
            raise _Abandoned
        env = self._make(self._abort)
        self._call.opened(env)
        reset = None
        if not self._abandoned:
            if env.worker is not None:
                self._abort.watch(env.worker)
            try:
                reset = _timed(lambda: self._reset(env.env))
            finally:
                self._abort.forget()
        with self._lock:
            if not self._abandoned:
                self._handed = True
                return env, reset
        self._call._closer(env.env)()
        raise _Abandoned

    def abandon(self) -> bool:
        """Tell the thread the rollout left; whether the env was handed over already (on its way to the
        event loop: the rollout must take it and close it, as no thread will)."""
        with self._lock:
            self._abandoned = True
            handed = self._handed
        self._abort.abort()
        return handed


async def open_env(
    call: EnvCalls, make: Callable[[StartAbort], BackendEnv], reset: Reset, late: LateCloses
) -> tuple[BackendEnv, Outcome | None]:
    """Build the env and reset it in one call in its thread (one round trip before the first turn), and
    return it with how its reset ended (None: not reset yet, see ``_EnvBuild.run``). A rollout cancelled
    meanwhile leaves the env to be closed on arrival."""
    build = _EnvBuild(call, make, reset)
    # The rollout waits on the signal: cancelling the pool's future would lose the env it still hands over.
    opening, opened = call.submit_signalled(build.run, kind="open")
    try:
        await opened
    except asyncio.CancelledError as cancelled:
        try:
            if build.abandon():
                # Handed over already: none of the env's code is left to run before it arrives, so it is
                # waited for however long the hand-over takes (on a busy machine, past close_timeout_s).
                await late.wait_to_end(opening)
            else:
                await late.wait(opening)
        except asyncio.CancelledError:
            pass  # cancelled once more while waiting (a deadline on top of a sibling's failure): the
            # build's outcome is still this rollout's to take care of, and ``cancelled`` goes on below
        if not opening.done():
            cancelled.add_note(
                f"its env was still being built or reset when the rollout stopped waiting after "
                f"{late.timeout_s:g} s: the thread doing it closes the env when that call returns"
            )
        elif not opening.cancelled() and opening.exception() is None:
            # Handed over before the rollout gave up on it.
            await close_after_failure(opening.result()[0], call, cancelled, late)
        raise
    opened_env = opening.result()
    call.returned(opening)
    return opened_env


async def close_after_failure(
    env: BackendEnv, call: EnvCalls, error: BaseException, late: LateCloses
) -> None:
    """Close the env of a failed rollout without masking ``error`` and without waiting forever.

    The close waits for any env call still running in its thread (a cancelled step finishes there);
    past ``late.timeout_s`` it is left to run when that call returns, and ``error`` says so.
    """
    closing = call.close(env)
    if not await late.wait_close(env, closing):
        error.add_note(
            f"the isolated env's close did not end {late.timeout_s + KILL_GRACE_S:g} s after it began "
            "(its worker is killed at close_timeout_s)"
            if env.remote
            else f"the env's close is still waiting after {late.timeout_s:g} s for a call stuck in its "
            "thread; it runs when that call returns (isolate_envs=True kills stuck envs instead)"
        )
        return
    try:
        closing.result()
    except Exception as close_error:
        error.add_note(f"closing the env also failed: {describe_exception(root_cause(close_error))}")
