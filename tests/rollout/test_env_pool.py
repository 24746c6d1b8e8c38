"""The runner's env pool (``EnvPool``)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

import pytest
from leaks import eventually

from gym_resilience.rollout import EnvPool
from gym_resilience.rollout import pool as pool_module
from gym_resilience.rollout.pool import CallHistory, idle_threads

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


async def test_calls_queued_before_shutdown_still_run_and_then_every_thread_is_let_go() -> None:
    pool = EnvPool(2, name="test-pool-end")
    release, ran = threading.Event(), []
    calls = [pool.submit(lambda i=i: (release.wait(SETTLE_S), ran.append(i))) for i in range(4)]
    pool.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: None)
    release.set()
    await asyncio.gather(*calls)
    assert sorted(ran) == [0, 1, 2, 3]
    # Let go, a thread waits for the next pool under another name.
    named = [t for t in threading.enumerate() if t.name.startswith("test-pool-end_")]
    assert await eventually(lambda: not [t for t in named if t.name.startswith("test-pool-end_")])


async def test_a_new_pool_takes_the_threads_an_earlier_pool_let_go() -> None:
    first = EnvPool(1, name="test-pool-first")
    thread = await first.submit(threading.current_thread)
    first.shutdown()
    assert await eventually(lambda: thread in idle_threads())
    second = EnvPool(1, name="test-pool-second")
    try:
        assert await second.submit(lambda: (threading.current_thread(), threading.current_thread().name)) == (
            thread,
            "test-pool-second_0",
        )
    finally:
        second.shutdown()
    assert thread.daemon


async def test_a_thread_let_go_ends_after_idle_s_without_a_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_module, "IDLE_S", 0.05)
    pool = EnvPool(1, name="test-pool-idle")
    thread = await pool.submit(threading.current_thread)
    pool.shutdown()
    await asyncio.to_thread(thread.join, SETTLE_S)
    assert not thread.is_alive() and thread not in idle_threads()


async def test_a_thread_stuck_in_a_call_is_not_taken_by_the_next_pool() -> None:
    stuck_pool = EnvPool(1, name="test-pool-stuck")
    release = threading.Event()
    stuck = stuck_pool.submit(lambda: (release.wait(SETTLE_S), threading.current_thread())[1])
    stuck_pool.shutdown()
    other = EnvPool(1, name="test-pool-other")
    try:
        free = await other.submit(threading.current_thread)
    finally:
        other.shutdown()
        release.set()
    assert free is not await stuck


async def test_an_exception_in_a_call_is_raised_where_it_is_awaited() -> None:
    pool = EnvPool(1, name="test-pool")

    def fail() -> None:
        raise ConnectionError("sandbox went away")

    try:
        with pytest.raises(ConnectionError, match="sandbox went away"):
            await pool.submit(fail)
    finally:
        pool.shutdown()


async def test_calls_submitted_together_run_in_order_on_one_thread_each_handed_over() -> None:
    pool = EnvPool(4, name="test-pool-all")
    order: list[str] = []

    def call(name: str) -> tuple[str, threading.Thread]:
        order.append(name)
        return name, threading.current_thread()

    try:
        futures = pool.submit_all(lambda: call("step"), lambda: call("close"))
        (step, step_thread), (close, close_thread) = await asyncio.gather(*futures)
    finally:
        pool.shutdown()
    assert (step, close, order) == ("step", "close", ["step", "close"])
    assert step_thread is close_thread


async def test_a_call_submitted_together_still_runs_when_the_one_before_it_was_cancelled() -> None:
    pool = EnvPool(1, name="test-pool-all")
    release, ran = threading.Event(), []
    busy = pool.submit(lambda: release.wait(SETTLE_S))
    step, close = pool.submit_all(lambda: ran.append("step"), lambda: ran.append("close"))
    step.cancel()
    release.set()
    try:
        await busy
        await close
    finally:
        pool.shutdown()
    assert ran == ["close"]


async def test_a_failing_call_submitted_together_does_not_stop_the_next() -> None:
    pool = EnvPool(1, name="test-pool-all")

    def fail() -> None:
        raise ConnectionError("sandbox went away")

    try:
        step, close = pool.submit_all(fail, lambda: "closed")
        with pytest.raises(ConnectionError, match="sandbox went away"):
            await step
        assert await close == "closed"
    finally:
        pool.shutdown()


async def test_cancelling_a_calls_signal_stops_the_wait_and_leaves_the_call_to_finish() -> None:
    pool = EnvPool(1, name="test-pool-signal")
    release = threading.Event()
    call, signal = pool.submit_signalled(lambda: release.wait(SETTLE_S) and "env")
    waiter = asyncio.ensure_future(signal)
    await asyncio.sleep(0)
    waiter.cancel()  # the rollout gives up: its wait ends, the call goes on in its thread
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert signal.cancelled() and not call.done()
    release.set()
    try:
        assert await call == "env"  # handed over whole, for teardown to close
    finally:
        pool.shutdown()


async def test_a_calls_signal_is_set_when_the_call_fails_and_the_call_raises_where_awaited() -> None:
    pool = EnvPool(1, name="test-pool-signal")

    def fail() -> None:
        raise ConnectionError("sandbox went away")

    try:
        call, signal = pool.submit_signalled(fail)
        assert await signal is None
        assert call.done()  # set in the same hand-over as the signal
        with pytest.raises(ConnectionError, match="sandbox went away"):
            call.result()
    finally:
        pool.shutdown()


async def test_a_call_submitted_after_a_stuck_one_waits_on_its_thread_and_the_others_stay_free() -> None:
    pool = EnvPool(2, name="test-pool")
    started, release, order = threading.Event(), threading.Event(), []
    stuck = pool.submit(lambda: (started.set(), release.wait(SETTLE_S), order.append("stuck")))
    assert await asyncio.to_thread(started.wait, SETTLE_S)
    stuck.cancel()  # its rollout gave up: the thread still runs it
    after = pool.submit_after(stuck, lambda: (order.append("after"), threading.current_thread().name)[1])
    # The second thread is free for another call while the first is stuck.
    assert await asyncio.wait_for(pool.submit(lambda: "free"), SETTLE_S) == "free"
    assert not after.done() and order == []
    release.set()
    assert await after == "test-pool_0" and order == ["stuck", "after"]
    pool.shutdown()


async def test_a_call_submitted_after_one_that_returned_runs_as_any_call() -> None:
    pool = EnvPool(1, name="test-pool")
    done = pool.submit(lambda: "done")
    assert await done == "done"
    assert await pool.submit_after(done, lambda: "next") == "next"
    pool.shutdown()


async def test_a_call_submitted_apart_runs_while_every_pool_thread_is_stuck() -> None:
    pool = EnvPool(1, name="test-pool")
    release = threading.Event()
    stuck = pool.submit(lambda: release.wait(SETTLE_S))
    apart = pool.submit_apart(lambda: (release.set(), threading.current_thread().name)[1])
    assert await asyncio.wait_for(apart, SETTLE_S) == "test-pool-apart"
    assert await stuck is True
    pool.shutdown()


@pytest.mark.parametrize("submit", ["submit", "submit_apart"])
async def test_a_call_raising_stop_iteration_raises_a_runtime_error_where_awaited(submit: str) -> None:
    """A future refuses StopIteration; before, the hand-over broke and dropped the outcomes with it."""
    pool = EnvPool(2, name="test-pool")
    fine = pool.submit(lambda: "fine")
    with pytest.raises(RuntimeError, match="an env call raised StopIteration") as info:
        await getattr(pool, submit)(lambda: next(iter(())))
    assert isinstance(info.value.__cause__, StopIteration)
    assert await fine == "fine"
    pool.shutdown()


def test_call_history_counts_calls_as_blocking_from_an_eighth_of_recent_calls() -> None:
    history = CallHistory()
    assert not history.blocking
    history.record(True)
    history.record(True)
    assert not history.blocking  # two blocked calls in a fresh history: 0.12
    history.record(True)
    assert history.blocking
    for _ in range(40):  # then fast calls only
        history.record(False)
    assert not history.blocking


def test_call_history_stays_under_blocking_for_a_blocked_call_among_fast_ones() -> None:
    """A fast env's call that lost the interpreter now and then (one in twenty) never makes calls blocking."""
    history = CallHistory()
    for index in range(200):
        history.record(index % 20 == 0)
        assert not history.blocking


def test_call_history_keeps_each_kind_of_call_apart() -> None:
    """A batch's fast builds and closes do not wash out what its blocking steps showed: the next batch's
    first steps get a thread each."""
    history = CallHistory()
    for _ in range(64):
        history.record(True, "step")
    for _ in range(128):
        history.record(False, "open")
        history.record(False, "close")
    assert history.blocking
    fast = CallHistory()
    for _ in range(64):
        fast.record(False, "step")
        fast.record(False, "open")
    assert not fast.blocking


async def test_an_adaptive_pool_takes_a_thread_for_each_waiting_call_while_calls_block() -> None:
    """Known to block, the pool runs four calls at once on four threads (a barrier of four passes),
    though only one is eager."""
    history = CallHistory()
    history.shares["call"] = 1.0
    pool = EnvPool(4, name="test-pool-blocking", eager=1, history=history)
    barrier = threading.Barrier(4, timeout=SETTLE_S)
    try:
        names = await asyncio.gather(
            *(pool.submit(lambda: (barrier.wait(), threading.current_thread().name)[1]) for _ in range(4))
        )
    finally:
        pool.shutdown()
    assert sorted(names) == [f"test-pool-blocking_{i}" for i in range(4)]


async def test_an_adaptive_pool_takes_threads_for_waiting_calls_once_a_blocked_call_ends() -> None:
    """Not yet known to block, the pool runs its one eager thread; the first call ends blocked (it slept),
    which tips the history, and the two calls waiting get a thread each at once."""
    history = CallHistory()
    history.shares["call"] = 0.12  # one blocked call short
    pool = EnvPool(3, name="test-pool-tipped", eager=1, history=history)
    barrier = threading.Barrier(2, timeout=SETTLE_S)
    try:
        first = pool.submit(lambda: time.sleep(0.05))
        waiting = [pool.submit(barrier.wait) for _ in range(2)]
        assert await first is None
        assert sorted(await asyncio.gather(*waiting)) == [0, 1]
    finally:
        pool.shutdown()
    assert history.blocking


async def test_an_adaptive_pool_whose_calls_do_not_block_runs_them_on_its_eager_threads() -> None:
    history = CallHistory()
    pool = EnvPool(8, name="test-pool-fast", eager=2, history=history)
    try:
        names = await asyncio.gather(
            *(pool.submit(lambda: threading.current_thread().name) for _ in range(64))
        )
    finally:
        pool.shutdown()
    assert set(names) <= {"test-pool-fast_0", "test-pool-fast_1"}
    assert not history.blocking
