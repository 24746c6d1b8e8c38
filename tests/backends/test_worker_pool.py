"""Warm worker processes: a runner's workers serve one rollout after another, each with a new env, and a
worker whose env left something behind, failed to close or passed a deadline is killed and replaced."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import pytest
from leaks import alive_workers, eventually, wait_until, worker_processes
from pool_envs import (
    leaving_env,
    leaving_tasks,
    ledger_env,
    ledger_tasks,
    read_ledger,
    session_sleeps,
    sleeping,
)

from gym_resilience import BatchRunner, RunnerConfig, UnsupportedConfigError
from gym_resilience.backends.pool import POOL_CLOSED
from gym_resilience.backends.process import IsolatedEnv, process_workers
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.errors import EnvClosedError
from gym_resilience.testing import ScriptableEnv

TESTS = str(Path(__file__).resolve().parent.parent)


def one_at_a_time(**options: Any) -> RunnerConfig:
    """Rollouts one after another on one worker process (unless ``options`` say otherwise)."""
    settings: dict[str, Any] = {"env_backend": "process", "max_concurrency": 1, "env_workers": 1}
    return RunnerConfig(**{**settings, **options})


async def metrics_of(runner: BatchRunner, *leaves: str) -> list[dict[str, float]]:
    result = await runner.generate(leaving_tasks(*leaves))
    assert not result.failures, result.failures
    return [trajectory.env_metrics for trajectory in result.trajectories]  # type: ignore[union-attr]


async def test_one_worker_serves_every_rollout_each_with_an_env_of_its_own() -> None:
    async with BatchRunner(ScriptedEngine(), leaving_env, one_at_a_time()) as runner:
        seen = await metrics_of(runner, "", "", "")
        assert len({metrics["pid"] for metrics in seen}) == 1
        assert runner.env_workers is not None and runner.env_workers.stats.started == 1
        assert len(worker_processes()) == 1
    assert worker_processes() == set()


async def test_an_env_that_sets_an_environment_variable_retires_its_worker_so_the_next_does_not_see_it() -> (
    None
):
    async with BatchRunner(ScriptedEngine(), leaving_env, one_at_a_time()) as runner:
        first, second, third = await metrics_of(runner, "variable", "", "")
        assert second["saw_variable"] == 0.0
        assert first["pid"] != second["pid"] == third["pid"]
    assert worker_processes() == set()


async def test_a_module_global_an_env_changes_is_seen_by_the_next_env_of_a_reused_worker_only() -> None:
    """What "fresh" does not cover, on both sides: module globals are not reset in a reused worker."""
    async with BatchRunner(ScriptedEngine(), leaving_env, one_at_a_time()) as runner:
        reused = [metrics["module_steps"] for metrics in await metrics_of(runner, "", "", "")]
    config = one_at_a_time(env_worker_reuse=False)
    async with BatchRunner(ScriptedEngine(), leaving_env, config) as runner:
        own = [metrics["module_steps"] for metrics in await metrics_of(runner, "", "", "")]
        assert runner.env_workers is not None and runner.env_workers.stats.started == 3
    assert reused == [0.0, 1.0, 2.0]
    assert own == [0.0, 0.0, 0.0]
    assert worker_processes() == set()


@pytest.mark.parametrize(
    ("leave", "reason"),
    [("process", "left 1 process"), ("thread", "thread(s) running"), ("failing close", "failed to close")],
)
async def test_a_worker_whose_env_left_something_behind_or_failed_to_close_is_replaced(
    leave: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gym_resilience.backends.pool")
    async with BatchRunner(ScriptedEngine(), leaving_env, one_at_a_time(skip_failed_rollouts=True)) as runner:
        result = await runner.generate(leaving_tasks(leave, "", ""))
        pids = [trajectory.env_metrics["pid"] for trajectory in result.trajectories]  # type: ignore[union-attr]
        assert pids[0] != pids[1] == pids[2]
        assert runner.env_workers is not None and runner.env_workers.stats.retired == 1
        # The retired worker's group was killed: a process its env left is gone with it.
        assert await eventually(lambda: len(worker_processes()) == 1)
    retirements = [r.getMessage() for r in caplog.records if r.name == "gym_resilience.backends.pool"]
    assert len(retirements) == 1 and reason in retirements[0], retirements
    assert worker_processes() == set()


@pytest.mark.parametrize(
    ("leave", "seen", "reason"),
    [
        ("signal handler", "sigterm_ignored", "its env changed the handler of SIGTERM"),
        ("blocked signal", "signals_blocked", "its env changed which signals are blocked: SIGUSR1"),
        ("alarm", "alarm_s", "its env left a timer set (signal.alarm or setitimer): ITIMER_REAL"),
        ("resource limit", "open_files_limit", "its env changed resource limits: RLIMIT_NOFILE"),
        ("listening socket", "open_fds", "its env left file descriptor(s) open: "),
    ],
)
async def test_a_worker_whose_env_left_process_state_behind_is_replaced_and_the_next_env_sees_none_of_it(
    leave: str, seen: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A pending alarm would end the next rollout's worker (the next env waits for it to fire); the others
    would change how the next env's process behaves."""
    caplog.set_level(logging.WARNING, logger="gym_resilience.backends.pool")
    async with BatchRunner(ScriptedEngine(), leaving_env, one_at_a_time()) as runner:
        first, second, third = await metrics_of(runner, leave, "", "")
        assert first["pid"] != second["pid"] == third["pid"]
        assert second[seen] == first[seen]  # the first reported before it left anything
    retirements = [r.getMessage() for r in caplog.records if r.name == "gym_resilience.backends.pool"]
    assert len(retirements) == 1 and reason in retirements[0], retirements
    assert worker_processes() == set()


@pytest.mark.parametrize(
    ("leave", "options"),
    [
        ("session", {}),  # retired for what its env left, and killed with that
        ("session", {"env_worker_reuse": False}),  # a worker per env ends what its env left as it exits
        ("daemon", {}),  # double-forked: the worker adopted it
        ("daemon", {"env_worker_reuse": False}),
        ("session then hang", {"env_step_timeout_s": 1.0}),  # killed at its env's step deadline
    ],
    ids=[
        "retired",
        "one env per worker",
        "daemon retired",
        "daemon one env per worker",
        "killed at a deadline",
    ],
)
async def test_a_process_an_env_started_in_a_session_of_its_own_ends_with_its_worker(
    leave: str, options: dict[str, Any]
) -> None:
    """A sandbox server started with ``start_new_session=True`` is out of the worker's process group,
    which the worker's kill ends: it still ends with the worker, and so does a daemon (double-forked into
    a session of its own, its parent gone), which the worker adopted."""
    config = one_at_a_time(skip_failed_rollouts=True, **options)
    with session_sleeps(len(leave) * 10 + len(options)) as marker:
        async with BatchRunner(ScriptedEngine(), leaving_env, config) as runner:
            result = await runner.generate(leaving_tasks(leave, "", marker=marker))
            assert not result.trajectories[1].is_placeholder
            assert await eventually(lambda: not sleeping(marker)), f"left running: {sleeping(marker)}"
        assert worker_processes() == set()


async def test_a_worker_past_its_step_deadline_is_killed_and_the_pool_never_exceeds_its_size() -> None:
    config = RunnerConfig(
        env_backend="process",
        skip_failed_rollouts=True,
        max_concurrency=8,
        env_workers=3,
        env_step_timeout_s=1.0,
    )
    async with BatchRunner(ScriptedEngine(), leaving_env, config) as runner:
        result = await runner.generate(leaving_tasks("hang", *[""] * 11))
        assert [trajectory.is_placeholder for trajectory in result.trajectories] == [True] + [False] * 11
        assert runner.env_workers is not None
        stats = runner.env_workers.stats
        assert stats.most_alive <= 3 and stats.retired >= 1
        assert len(worker_processes()) == alive_workers(runner) <= 3
    assert worker_processes() == set()


async def test_workers_are_shared_across_batches_prestarted_and_ended_by_close(tmp_path: Path) -> None:
    config = one_at_a_time(env_workers=2, max_concurrency=2, env_workers_prestart=True)
    runner = BatchRunner(ScriptedEngine(), ledger_env, config)
    # One rollout: only the prestart starts a second worker, and it was running when the env was built.
    result = await runner.generate(ledger_tasks(tmp_path / "ledger", ""))
    assert not result.failures, result.failures
    [(_, first, _, workers_then)] = read_ledger(tmp_path / "ledger")[0]
    assert workers_then == "2"
    assert runner.env_workers is not None and runner.env_workers.stats.started == 2
    result = await runner.generate(ledger_tasks(tmp_path / "ledger", "", "", "", ""))
    second = {pid for _, pid, _, _ in read_ledger(tmp_path / "ledger")[0]}
    assert first in second and len(second) == 2 and runner.env_workers.stats.started == 2
    await runner.close()
    await runner.close()  # idempotent
    assert worker_processes() == set()
    with pytest.raises(RuntimeError, match="this BatchRunner is closed"):
        await runner.generate(leaving_tasks(""))


async def test_every_rollout_gets_an_env_of_its_own_on_reused_workers_closed_exactly_once(
    tmp_path: Path,
) -> None:
    config = RunnerConfig(env_backend="process", max_concurrency=2, env_workers=2)
    tasks = ledger_tasks(tmp_path / "ledger", *[""] * 8)
    async with BatchRunner(ScriptedEngine(), ledger_env, config) as runner:
        result = await runner.generate(tasks)
        assert not result.failures, result.failures
        assert runner.env_workers is not None and runner.env_workers.stats.started <= 2
    builds, closes = read_ledger(tmp_path / "ledger")
    built = [env_id for env_id, _, _, _ in builds]
    assert sorted(instance for _, _, instance, _ in builds) == sorted(task.instance_id for task in tasks)
    assert len(set(built)) == len(tasks)  # a new env for each rollout
    assert Counter(closes) == Counter(built)  # each closed once, none twice
    pids = {pid for _, pid, _, _ in builds}
    assert len(pids) <= 2  # the workers served several envs each
    served = {trajectory.env_metrics["pid"] for trajectory in result.trajectories}  # type: ignore[union-attr]
    assert served == set(map(float, pids))
    assert worker_processes() == set()


async def test_rollouts_still_to_start_when_the_runner_closes_fail_saying_its_workers_were_closed(
    tmp_path: Path,
) -> None:
    go_on = tmp_path / "go on"
    config = one_at_a_time(skip_failed_rollouts=True, max_failed_fraction=0.9)
    runner = BatchRunner(ScriptedEngine(), leaving_env, config)
    batch = asyncio.ensure_future(runner.generate(leaving_tasks("wait", "", "", marker=str(go_on))))
    assert await eventually(lambda: len(worker_processes()) == 1)  # the first rollout's env is waiting
    await runner.close()
    go_on.touch()
    result = await batch
    assert [trajectory.is_placeholder for trajectory in result.trajectories] == [False, True, True]
    errors = [failure.exception for failure in result.failures]
    closed = (EnvClosedError, f"cannot start: {POOL_CLOSED}")
    assert [(type(error), str(error)) for error in errors] == [closed, closed]
    assert await eventually(lambda: worker_processes() == set())


async def test_a_runner_collected_without_close_ends_its_workers() -> None:
    runner = BatchRunner(ScriptedEngine(), leaving_env, one_at_a_time())
    await metrics_of(runner, "")
    assert len(worker_processes()) == 1
    del runner
    gc.collect()
    assert await eventually(lambda: worker_processes() == set())


async def test_a_worker_killed_while_idle_is_replaced_without_failing_the_next_rollout() -> None:
    async with BatchRunner(ScriptedEngine(), leaving_env, one_at_a_time()) as runner:
        [before] = await metrics_of(runner, "")
        os.kill(int(before["pid"]), signal.SIGKILL)
        [after] = await metrics_of(runner, "")
        assert after["pid"] != before["pid"]
    assert worker_processes() == set()


def test_a_pool_take_waits_for_a_worker_and_an_abort_ends_the_wait() -> None:
    from gym_resilience.backends.protocol import StartAbort

    pool = process_workers(size=1, reuse=True)
    env = IsolatedEnv(ScriptableEnv, workers=pool)
    abort = StartAbort()
    waiting = asyncio.new_event_loop()
    try:
        taking = waiting.run_in_executor(None, lambda: IsolatedEnv(ScriptableEnv, workers=pool, abort=abort))
        assert not wait_until(taking.done, timeout_s=0.5)  # the only worker is busy
        abort.abort()
        with pytest.raises(EnvClosedError):
            waiting.run_until_complete(taking)
    finally:
        waiting.close()
        env.close()
        pool.close()
    assert pool.stats.alive == 0 and worker_processes() == set()


def run_script(body: str) -> subprocess.Popen[str]:
    script = f"import sys\nsys.path.insert(0, {TESTS!r})\n" + body
    return subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


POOLED_BATCH = textwrap.dedent(
    """
    import asyncio, os
    import psutil
    from pool_envs import leaving_env, leaving_tasks, session_sleeps, sleeping
    from gym_resilience import BatchRunner, RunnerConfig
    from gym_resilience.engines.scripted import ScriptedEngine

    config = RunnerConfig(env_backend="process", max_concurrency=2, env_workers_prestart=True)
    runner = BatchRunner(ScriptedEngine(), leaving_env, config)
    result = asyncio.run(runner.generate(leaving_tasks("", "")))
    me = os.getpid()
    workers = [p.pid for p in psutil.Process().children(recursive=True) if p.ppid() != me]
    print(*workers, flush=True)
    """
)


def process_if_alive(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["exit", "sigkill"])
def test_pooled_workers_do_not_outlive_their_program_at_exit_or_killed(ending: str) -> None:
    child = run_script(POOLED_BATCH + ("" if ending == "exit" else "import time; time.sleep(600)\n"))
    try:
        assert child.stdout is not None
        pids = child.stdout.readline().split()
        assert len(pids) == 2, pids
        # On "exit" the program may end its workers before they are looked up here: gone already.
        workers = [worker for pid in pids if (worker := process_if_alive(int(pid))) is not None]
        if ending == "sigkill":
            assert len(workers) == 2  # the program sleeps: its workers are alive until it is killed
            child.kill()
    finally:
        _, stderr = child.communicate(timeout=60)
    if ending == "exit":
        assert child.returncode == 0, stderr
    assert wait_until(lambda: not any(worker.is_running() for worker in workers), timeout_s=15)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"env_backend": "process", "env_workers": 0}, r"^env_workers: must be a positive integer, got 0$"),
        ({"env_workers": 4}, r"^env_workers: needs env_backend='process' or 'ray'"),
        ({"env_workers_prestart": True}, r"^env_workers_prestart: needs env_backend='process' or 'ray'"),
        ({"env_worker_reuse": False}, r"^env_worker_reuse: needs env_backend='process' or 'ray'"),
    ],
)
def test_worker_pool_options_are_checked_at_construction(options: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=message):
        RunnerConfig(**options)


def test_worker_pool_options_read_from_data_are_typed() -> None:
    config = RunnerConfig.from_mapping(
        {"env_backend": "process", "env_workers": 4, "env_workers_prestart": True, "env_worker_reuse": False}
    )
    assert (config.env_workers, config.env_workers_prestart, config.env_worker_reuse) == (4, True, False)
    with pytest.raises(UnsupportedConfigError, match=r"^runner\.env_workers: expected an integer or null"):
        RunnerConfig.from_mapping({"env_backend": "process", "env_workers": "4"})


def test_the_pool_size_is_env_workers_else_max_concurrency() -> None:
    assert RunnerConfig(env_backend="process", max_concurrency=8).env_pool_size == 8
    assert RunnerConfig(env_backend="process", max_concurrency=8, env_workers=3).env_pool_size == 3
    assert RunnerConfig(env_backend="process", max_concurrency=None).env_pool_size is None
