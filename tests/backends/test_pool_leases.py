"""The pool's bookkeeping of a worker's envs and leases: a failed open retires the worker, a prestarted
worker serves its first env with or without reuse, an idle worker found dead is dropped, and a reused
worker's death at an open is replaced within the start deadline: as often as its host is found lost (a
Ray node), else once, so a factory that crashes its worker is not run again and again."""

from __future__ import annotations

import asyncio
import os
import pickle
import resource
import signal
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
    """A worker whose every open raises EnvWorkerDiedError, as one whose factory crashes it does (or, with
    ``host_lost``, as an actor on a lost node does)."""

    def __init__(self, served: int, *, host_lost: bool = False) -> None:
        self.envs_served = served
        self.killed = False
        self.lost_with_host = host_lost

    lost = None
    reusable = False
    retired_because = None

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


def test_a_reused_workers_death_is_replaced_once_so_a_crashing_factory_runs_at_most_twice() -> None:
    started = iter([FakeWorker(served=1), FakeWorker(served=1), FakeWorker(served=1)])
    pool: WorkerPool[Any] = WorkerPool(lambda: next(started), size=3)
    opens: list[float | None] = []

    def crash(worker: FakeWorker, timeout: float | None) -> tuple[int, None]:
        opens.append(timeout)
        raise EnvWorkerDiedError(operation="start")

    with pytest.raises(EnvWorkerDiedError):
        lease(pool, crash, None, 10.0)
    assert len(opens) == 2
    assert opens[0] is not None and opens[1] is not None
    assert opens[1] <= opens[0] <= 10.0  # the second open gets what is left of the one deadline


def test_reused_workers_lost_with_their_host_are_replaced_until_an_open_succeeds() -> None:
    # A node lost with several idle actors on it: each is found dead at its open, none by its factory.
    lost = [FakeWorker(served=1, host_lost=True) for _ in range(3)]
    started = iter([*lost, FakeWorker(served=0)])
    pool: WorkerPool[Any] = WorkerPool(lambda: next(started), size=4)
    opens: list[FakeWorker] = []

    def open_env(worker: FakeWorker, timeout: float | None) -> tuple[int, str]:
        opens.append(worker)
        if worker.lost_with_host:
            raise EnvWorkerDiedError(operation="start")
        return 1, "opened"

    leased, opened = lease(pool, open_env, None, 10.0)
    assert opened == "opened" and leased.worker is opens[-1]
    assert opens[:3] == lost and all(worker.killed for worker in lost)


def test_a_fresh_workers_death_is_not_retried() -> None:
    pool: WorkerPool[Any] = WorkerPool(lambda: FakeWorker(served=0), size=3)
    opens: list[float | None] = []

    def crash(worker: FakeWorker, timeout: float | None) -> tuple[int, None]:
        opens.append(timeout)
        raise EnvWorkerDiedError(operation="start")

    with pytest.raises(EnvWorkerDiedError):
        lease(pool, crash, None, None)
    assert opens == [None]


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
