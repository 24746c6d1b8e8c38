"""The pool's bookkeeping of a worker's envs and leases: a failed open retires the worker, a prestarted
worker serves its first env with or without reuse, an idle worker found dead is dropped, and the death
at an open of a worker that waited idle (prestarted or reused) is replaced within the start deadline: as
often as its host is found lost (a Ray node), else once, so a factory that crashes its worker is not run
again and again."""

from __future__ import annotations

import asyncio
import os
import pickle
import resource
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from leaks import eventually
from pool_envs import leaving_env, leaving_tasks, ledger_env, ledger_tasks, read_ledger

from gym_resilience import BatchRunner, RunnerConfig
from gym_resilience.backends.pool import EnvTurns, WorkerPool, lease
from gym_resilience.backends.protocol import unpack_ending
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.errors import EnvWorkerDiedError


def open_reply() -> bytes:
    """What a worker answers to ``open`` or ``close``: a reply, with no verdict on what the env left."""
    data = pickle.dumps((pickle.dumps(("ok", {"spaces": None})), None))
    assert unpack_ending(data)[1] is None
    return data


def test_an_open_whose_description_cannot_be_read_retires_the_worker() -> None:
    turns = EnvTurns(reuse=True)
    turns.next()

    def unreadable(data: bytes) -> Any:
        raise ModuleNotFoundError("No module named 'plugin_spaces'")

    with pytest.raises(ModuleNotFoundError):
        turns.opened(open_reply(), unreadable)
    assert not turns.reusable(running=True)
    assert turns.retired_because is not None and "plugin_spaces" in turns.retired_because


def test_an_open_that_reads_keeps_the_worker_for_the_next_env() -> None:
    turns = EnvTurns(reuse=True)
    turns.next()
    assert turns.opened(open_reply(), pickle.loads) == ("ok", {"spaces": None})
    assert not turns.reusable(running=True)  # its env is open
    turns.judged(open_reply())  # the close's reply
    assert turns.reusable(running=True)


@pytest.mark.parametrize("reuse", [True, False])
def test_a_worker_that_served_no_env_yet_may_take_one_with_or_without_reuse(reuse: bool) -> None:
    turns = EnvTurns(reuse=reuse)
    assert turns.reusable(running=True)
    turns.next()
    turns.opened(open_reply(), pickle.loads)
    turns.judged(open_reply())
    assert turns.reusable(running=True) is reuse


class FakeWorker:
    """A worker whose open raises EnvWorkerDiedError when ``dies`` (as one whose factory crashes it does, or,
    with ``host_lost``, as an actor on a lost node does), and opens an env otherwise."""

    def __init__(self, *, dies: bool = True, host_lost: bool = False) -> None:
        self.dies = dies
        self.died = False
        self.killed = False
        self.lost_with_host = host_lost

    lost = None
    retired_because = None

    @property
    def reusable(self) -> bool:
        return not (self.died or self.killed)

    def serving(self, generation: int) -> bool:
        return False

    def request(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("no env was opened")

    def close_env(self, generation: int) -> None:
        pass

    def kill(self) -> None:
        self.killed = True

    def gone(self) -> bool:
        return False

    def host_lost(self) -> bool:
        return self.lost_with_host


def open_or_die(opens: list[FakeWorker]) -> Callable[[FakeWorker, float | None], tuple[int, str]]:
    """An open that records each worker it is given, and dies with the workers that die."""

    def open_env(worker: FakeWorker, timeout: float | None) -> tuple[int, str]:
        opens.append(worker)
        if worker.dies:
            worker.died = True
            raise EnvWorkerDiedError(operation="start")
        return 1, "opened"

    return open_env


def idle_pool(*workers: FakeWorker, size: int) -> WorkerPool[Any]:
    """A pool of ``size`` whose ``workers`` wait idle (prestarted); the next workers it starts open envs."""
    started = iter(workers)
    pool: WorkerPool[Any] = WorkerPool(lambda: next(started, None) or FakeWorker(dies=False), size=size)
    pool.prestart(len(workers))
    return pool


def test_an_idle_workers_death_is_replaced_once_so_a_crashing_factory_runs_at_most_twice() -> None:
    pool = idle_pool(FakeWorker(), FakeWorker(), size=3)
    timeouts: list[float | None] = []
    opens: list[FakeWorker] = []
    open_env = open_or_die(opens)

    def crash(worker: FakeWorker, timeout: float | None) -> tuple[int, str]:
        timeouts.append(timeout)
        return open_env(worker, timeout)

    with pytest.raises(EnvWorkerDiedError):
        lease(pool, crash, None, 10.0)
    assert len(timeouts) == 2
    assert timeouts[0] is not None and timeouts[1] is not None
    assert timeouts[1] <= timeouts[0] <= 10.0  # the second open gets what is left of the one deadline


@pytest.mark.parametrize("prestarted", [True, False])
def test_idle_workers_lost_with_their_host_are_replaced_until_an_open_succeeds(prestarted: bool) -> None:
    # A node lost with several idle actors on it: each is found dead at its open, none by its factory. An
    # actor prestarted on it never served an env, and is replaced as a reused one is.
    lost = [FakeWorker(host_lost=True) for _ in range(3)]
    pool = idle_pool(*lost, size=4)
    if not prestarted:  # they served an env each, and came back
        taken = [pool.take()[0] for _ in lost]
        for worker in taken:
            pool.give_back(worker)
    opens: list[FakeWorker] = []
    leased, opened = lease(pool, open_or_die(opens), None, 10.0)
    assert opened == "opened" and leased.worker is opens[-1] and not leased.worker.dies
    assert sorted(map(id, opens[:3])) == sorted(map(id, lost)) and all(worker.killed for worker in lost)


def test_a_workers_death_at_its_first_open_is_not_retried() -> None:
    pool: WorkerPool[Any] = WorkerPool(FakeWorker, size=3)
    opens: list[FakeWorker] = []
    with pytest.raises(EnvWorkerDiedError):
        lease(pool, open_or_die(opens), None, None)
    assert len(opens) == 1


def test_prestarted_workers_serve_their_envs_without_reuse(tmp_path: Path) -> None:
    config = RunnerConfig(
        env_backend="process",
        max_concurrency=2,
        env_workers=2,
        env_worker_reuse=False,
        env_workers_prestart=True,
    )

    async def main() -> tuple[int, int]:
        async with BatchRunner(ScriptedEngine(), ledger_env, config) as runner:
            # One rollout: only the prestart starts the second worker.
            result = await runner.generate(ledger_tasks(tmp_path / "ledger", ""))
            assert not result.failures, result.failures
            stats = runner.env_workers.stats  # type: ignore[union-attr]
            return stats.started, stats.retired

    started, retired = asyncio.run(main())
    [(_, _, _, workers_then)] = read_ledger(tmp_path / "ledger")[0]
    assert workers_then == "2"  # both worker processes were running when the env was built
    assert started == 2  # a prestarted worker served the env: none was started for it
    assert retired == 1  # the one that served it, after its env; the other waits for the next env


async def test_idle_workers_killed_from_outside_are_dropped_and_the_next_rollout_gets_a_live_one() -> None:
    config = RunnerConfig(env_backend="process", max_concurrency=2, env_workers=2)
    async with BatchRunner(ScriptedEngine(), leaving_env, config) as runner:
        result = await runner.generate(leaving_tasks("", ""))
        pids = {int(trajectory.env_metrics["pid"]) for trajectory in result.trajectories}  # type: ignore[union-attr]
        assert len(pids) == 2
        for pid in pids:  # both idle workers die (the OOM killer, say) before the next batch
            os.kill(pid, signal.SIGKILL)
        assert await eventually(lambda: not any(psutil.pid_exists(pid) for pid in pids))
        result = await runner.generate(leaving_tasks(""))
        assert not result.failures, result.failures
        [after] = result.trajectories
        assert int(after.env_metrics["pid"]) not in pids  # type: ignore[union-attr]
        workers = runner.env_workers
        assert workers is not None and workers.stats.retired == 2 and workers.stats.alive == 1


async def test_idle_workers_are_checked_with_more_than_1024_files_open() -> None:
    # A trainer holds many files (Ray, vLLM, sockets): select() refuses descriptors past 1024.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2048
    assert hard == resource.RLIM_INFINITY or hard >= wanted, (
        f"this test needs {wanted} open files, hard limit {hard}"
    )
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    held: list[int] = []
    try:
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
        config = RunnerConfig(env_backend="process", max_concurrency=2, env_workers=2)
        async with BatchRunner(ScriptedEngine(), leaving_env, config) as runner:
            for _ in range(3):  # the second and third take idle workers, checking each is alive
                result = await asyncio.wait_for(runner.generate(leaving_tasks("", "")), 120)
                assert not result.failures, result.failures
            workers = runner.env_workers
            assert workers is not None and workers.stats.started == 2
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
