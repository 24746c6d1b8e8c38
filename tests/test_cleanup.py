"""wait_through_cancellation: a teardown step is awaited through cancellations, and they come after it."""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import pytest

from gym_resilience.cleanup import wait_through_cancellation


async def settle() -> None:
    """Let the tasks that are ready run (a few loop iterations)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_step_cancelled_once_is_awaited_to_its_end_then_the_cancellation_is_delivered() -> None:
    step: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    waiter = asyncio.create_task(wait_through_cancellation(step, 60.0))
    await settle()
    waiter.cancel("sibling failed")
    await settle()
    assert not waiter.done() and not step.cancelled()
    step.set_result("closed")
    with pytest.raises(asyncio.CancelledError, match="sibling failed"):
        await waiter
    assert step.result() == "closed"


async def test_a_step_cancelled_twice_is_still_awaited_and_the_first_cancellation_is_delivered_once() -> None:
    step: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiter = asyncio.create_task(wait_through_cancellation(step, 60.0))
    await settle()
    waiter.cancel("first")
    await settle()
    waiter.cancel("second")
    await settle()
    assert not waiter.done() and not step.done()
    step.set_result(None)
    with pytest.raises(asyncio.CancelledError, match="first"):
        await waiter


async def test_a_step_without_a_timeout_is_awaited_however_often_it_is_cancelled() -> None:
    step: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiter = asyncio.create_task(wait_through_cancellation(step))
    await settle()
    for _ in range(3):
        waiter.cancel()
        await settle()
        assert not waiter.done()
    step.set_result(None)
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert step.done()


async def test_a_step_past_its_timeout_is_left_to_its_thread_counted_and_its_failure_retrieved() -> None:
    loop = asyncio.get_running_loop()
    unretrieved: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))
    release = threading.Event()

    def stuck_close() -> None:
        release.wait()
        raise OSError("socket already gone")

    left: list[asyncio.Future[Any]] = []
    try:
        step = loop.run_in_executor(None, stuck_close)
        assert await wait_through_cancellation(step, 0.05, left=left.append) is False
        assert left == [step] and not step.done()
        release.set()
        await asyncio.wait({step}, timeout=10)
        assert step.done()
        del step, left  # dropped unretrieved, a failed future reports itself to the loop's handler
        gc.collect()
        await settle()
        assert unretrieved == []
    finally:
        release.set()
        loop.set_exception_handler(None)


async def test_a_step_past_its_timeout_delivers_the_cancellation_that_came_meanwhile() -> None:
    step: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    left: list[asyncio.Future[Any]] = []
    waiter = asyncio.create_task(wait_through_cancellation(step, 0.1, left=left.append))
    await settle()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiter, 10)
    assert left == [step] and not step.done()
    step.cancel()


async def test_an_exception_in_the_step_is_left_on_the_step_and_the_wait_reports_it_finished() -> None:
    step: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    step.set_exception(OSError("close failed"))
    left: list[asyncio.Future[Any]] = []
    assert await wait_through_cancellation(step, 1.0, left=left.append) is True
    assert left == []
    with pytest.raises(OSError, match="close failed"):
        step.result()


async def test_an_exception_in_a_step_cancelled_meanwhile_does_not_replace_the_cancellation() -> None:
    step: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiter = asyncio.create_task(wait_through_cancellation(step, 60.0))
    await settle()
    waiter.cancel()
    await settle()
    step.set_exception(OSError("close failed"))
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert isinstance(step.exception(), OSError)
