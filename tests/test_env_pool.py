"""The runner's env pool (``EnvPool``)."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from gym_resilience.rollout import EnvPool

SETTLE_S = 10.0

_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("test_pool_var", default="unset")


async def test_a_call_runs_in_a_pool_thread_in_the_context_it_was_submitted_from() -> None:
    pool = EnvPool(2, name="test-pool")
    _VAR.set("rollout 7")
    try:
        name, value = await pool.submit(lambda: (threading.current_thread().name, _VAR.get()))
    finally:
        pool.shutdown()
    assert (name, value) == ("test-pool_0", "rollout 7")


async def test_a_call_cancelled_before_a_thread_takes_it_never_runs() -> None:
    pool = EnvPool(1, name="test-pool")
    release, ran = threading.Event(), []
    busy = pool.submit(lambda: release.wait(SETTLE_S))
    queued = pool.submit(lambda: ran.append("queued"))
    queued.cancel()
    release.set()
    assert await busy is True
    after = await pool.submit(lambda: ran.append("after"))
    pool.shutdown()
    assert after is None and ran == ["after"]


async def test_calls_queued_before_shutdown_still_run_and_then_every_thread_ends() -> None:
    pool = EnvPool(2, name="test-pool-end")
    release, ran = threading.Event(), []
    calls = [pool.submit(lambda i=i: (release.wait(SETTLE_S), ran.append(i))) for i in range(4)]
    pool.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: None)
    release.set()
    await asyncio.gather(*calls)
    assert sorted(ran) == [0, 1, 2, 3]
    for thread in [t for t in threading.enumerate() if t.name.startswith("test-pool-end")]:
        await asyncio.to_thread(thread.join, SETTLE_S)
        assert not thread.is_alive()


async def test_an_exception_in_a_call_is_raised_where_it_is_awaited() -> None:
    pool = EnvPool(1, name="test-pool")

    def fail() -> None:
        raise ConnectionError("sandbox went away")

    try:
        with pytest.raises(ConnectionError, match="sandbox went away"):
            await pool.submit(fail)
    finally:
        pool.shutdown()
