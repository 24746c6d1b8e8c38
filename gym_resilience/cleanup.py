"""Teardown that a cancellation cannot cut short: the one way this library waits for a cleanup step.

A close, a build being abandoned, servers being stopped: if a cancellation (a sibling failed, a deadline
passed, Ctrl-C) could interrupt the wait for such a step, the resource it was releasing would leak. So the
step is awaited to its end, or to its deadline, whatever cancellations arrive meanwhile, and the
cancellation is delivered afterwards.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["finish", "finish_quietly", "settable", "wait_through_cancellation"]

T = TypeVar("T")

logger = logging.getLogger(__name__)


async def wait_through_cancellation(
    step: asyncio.Future[Any],
    timeout_s: float | None = None,
    *,
    left: Callable[[asyncio.Future[Any]], None] | None = None,
    nudge: Callable[[], None] | None = None,
) -> bool:
    """Wait for ``step`` up to ``timeout_s`` (None: no limit), even if cancelled once or more meanwhile.

    Returns whether the step finished (with a result, an exception, or cancelled itself): its outcome stays
    on ``step`` for the caller to read. A step still running at the deadline is left to run (to its
    thread, for an executor's future) and handed to ``left``, so the caller can count it; nobody awaits
    it any more, so its outcome is retrieved when it comes, never reported as unretrieved. ``nudge`` is
    called before the wait and on each cancellation: the source that settles ``step`` hands over what it
    may still hold (a wait through cancellation is teardown, often after an interrupt cut a hand-over).

    Raises:
        asyncio.CancelledError: the first cancellation that arrived while waiting, once the step finished
            or its time was up; the step is never cancelled by it.

    Example:
        >>> closing = loop.run_in_executor(pool, env.close)  # doctest: +SKIP
        >>> if not await wait_through_cancellation(closing, 5.0, left=late.left):  # doctest: +SKIP
        ...     print("the close is left to its thread")
    """
    if step.done():  # the common case for a close that ran right after the env's last call
        return True
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    cancellation: asyncio.CancelledError | None = None
    if nudge is not None:
        nudge()
    while not step.done() and (deadline is None or loop.time() < deadline):
        try:
            await asyncio.wait({step}, timeout=None if deadline is None else deadline - loop.time())
        except asyncio.CancelledError as cancelled:
            cancellation = cancellation or cancelled
            if nudge is not None:
                nudge()
    if not step.done():
        step.add_done_callback(_retrieve)
        if left is not None:
            left(step)
    if cancellation is not None:
        raise cancellation
    return step.done()


def _retrieve(step: asyncio.Future[Any]) -> None:
    if not step.cancelled():
        step.exception()


async def finish(step: Awaitable[T]) -> T:
    """Await a cleanup step (an abort, a shutdown, a join) to its end, whatever cancellations arrive
    meanwhile: then the first of them is raised, else the step's own outcome."""
    future = asyncio.ensure_future(step)
    try:
        await wait_through_cancellation(future)
    except asyncio.CancelledError:
        if not future.cancelled():
            future.exception()  # retrieved: the cancellation is what propagates
        raise
    return future.result()


async def finish_quietly(step: Awaitable[object], what: str) -> None:
    """``finish`` a cleanup step whose failure must not replace the exception (or cancellation) already
    propagating: it is logged instead."""
    try:
        await finish(step)
    except Exception:
        logger.debug("%s failed", what, exc_info=True)


def settable(error: BaseException, source: str) -> BaseException:
    """``error`` as an asyncio future can raise it. A future refuses ``StopIteration`` (it would end the
    generator awaiting it): that one comes wrapped in a ``RuntimeError`` that names ``source`` (what raised
    it, such as "the env factory") and has it as its cause. Any other error is returned as it is."""
    if not isinstance(error, StopIteration):
        return error
    wrapped = RuntimeError(f"{source} raised StopIteration: {error!r}")
    wrapped.__cause__ = error
    return wrapped
