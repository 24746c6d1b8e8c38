"""EnvThreads: the runner's env threads, with real threads (no doubles: threads are the capability)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait

import pytest
from doubles import tasks
from leaks import EnvCounts, counting_factory, no_leaks

from gym_resilience import BatchRunner, RunnerConfig
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.env_threads import EnvThreads

IDLE_S = 0.05


def workers(prefix: str) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith(prefix)]


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


def test_calls_run_in_worker_threads_and_return_their_results_and_exceptions() -> None:
    pool = EnvThreads(4, idle_s=IDLE_S, name="results")

    def fail() -> None:
        raise ConnectionError("tool server went away")

    ok = pool.submit(threading.current_thread)
    failed = pool.submit(fail)
    assert ok.result(timeout=5).name.startswith("results_")
    with pytest.raises(ConnectionError, match="went away"):
        failed.result(timeout=5)


def test_no_more_than_max_threads_run_at_once_and_the_rest_queue() -> None:
    pool = EnvThreads(3, idle_s=IDLE_S, name="bounded")
    gate = threading.Event()
    futures = [pool.submit(gate.wait, 5) for _ in range(10)]
    assert wait_for(lambda: len(workers("bounded_")) == 3)
    assert pool.pending == 10
    gate.set()
    wait(futures, timeout=5)
    assert all(future.result() for future in futures)
    assert len(workers("bounded_")) <= 3


def test_threads_are_reused_while_busy_and_end_after_idle_s_without_work() -> None:
    pool = EnvThreads(4, idle_s=IDLE_S, name="idle")
    names = {pool.submit(lambda: threading.current_thread().name).result(timeout=5) for _ in range(20)}
    assert len(names) == 1, "one call at a time needs one thread, started once"
    assert pool.pending == 0
    assert wait_for(lambda: workers("idle_") == [])


def test_a_call_cancelled_before_it_runs_never_runs_and_stops_counting() -> None:
    pool = EnvThreads(1, idle_s=IDLE_S, name="cancel")
    gate, ran = threading.Event(), threading.Event()
    blocking = pool.submit(gate.wait, 5)
    queued: Future[None] = pool.submit(ran.set)
    assert queued.cancel()
    gate.set()
    blocking.result(timeout=5)
    assert wait_for(lambda: pool.pending == 0)
    assert not ran.is_set()


def test_a_stuck_call_keeps_its_thread_and_counts_as_pending_but_others_still_run() -> None:
    pool = EnvThreads(4, idle_s=IDLE_S, name="stuck")
    release = threading.Event()
    stuck = pool.submit(release.wait, 10)
    assert pool.submit(lambda: 42).result(timeout=5) == 42
    assert pool.pending == 1
    release.set()
    stuck.result(timeout=5)
    assert wait_for(lambda: pool.pending == 0 and workers("stuck_") == [])


def test_after_shutdown_new_calls_are_refused_and_queued_ones_still_run() -> None:
    pool = EnvThreads(1, idle_s=IDLE_S, name="shut")
    gate = threading.Event()
    first, second = pool.submit(gate.wait, 5), pool.submit(lambda: "closed later")
    pool.shutdown(wait=False)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None)
    gate.set()
    assert first.result(timeout=5) and second.result(timeout=5) == "closed later"


async def test_back_to_back_batches_share_env_threads_and_leave_none_behind() -> None:
    counts = EnvCounts()
    runner = BatchRunner(ScriptedEngine(), counting_factory(counts), RunnerConfig(max_turns=2))
    with no_leaks(counts):
        await runner.generate(tasks(32))
        first = runner._env_threads
        await runner.generate(tasks(32))
        assert runner._env_threads is first, "an idle pool is kept for the next batch"
    assert counts.created == counts.closed == 64


async def test_a_batch_after_one_that_left_a_call_stuck_takes_fresh_env_threads() -> None:
    counts, release = EnvCounts(), threading.Event()
    runner = BatchRunner(ScriptedEngine(), counting_factory(counts), RunnerConfig(max_turns=1))
    with no_leaks(counts):
        await runner.generate(tasks(4))
        first = runner._env_threads
        assert first is not None
        first.submit(release.wait, 10)  # what a hung env's call looks like to the pool
        await runner.generate(tasks(4))
        assert runner._env_threads is not first
        release.set()
