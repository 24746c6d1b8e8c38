"""Isolated envs: deadlines that kill a worker process, typed errors across the process boundary, and no
process left behind on any exit path."""

from __future__ import annotations

import os

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # check_env's render checks open pygame windows otherwise

import functools
import gc
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import psutil
import pytest
from doubles import Fault, env_fn, tasks
from isolation_helpers import HANGING_RESET, HANGING_STEP, timed, worker_of
from leaks import wait_until
from pool_envs import LeavingEnv, session_sleeps, sleeping

from gym_resilience.backends.process import IsolatedEnv
from gym_resilience.backends.resilient import ResilientEnv
from gym_resilience.errors import (
    EnvClosedError,
    EnvCloseError,
    EnvTimeoutError,
    EnvWorkerDiedError,
)
from gym_resilience.retry import RetryPolicy
from gym_resilience.testing import ScriptableEnv

TESTS = str(Path(__file__).resolve().parent.parent)
CARTPOLE = functools.partial(gymnasium.make, "CartPole-v1")
HANGING_CLOSE = env_fn(Fault(kind="hang", phase="close"))
# Time for killing and reaping a worker past its deadline, on a loaded two-core CI machine.
MARGIN_S = 1.5


def descendants() -> set[int]:
    return {process.pid for process in psutil.Process().children(recursive=True)}


def multiprocessing_helpers() -> set[int]:
    """The fork server and resource tracker, which the first isolated env of a session starts."""
    return {
        process.pid
        for process in psutil.Process().children(recursive=True)
        if any("forkserver" in part or "resource_tracker" in part for part in process.cmdline())
    }


@pytest.fixture
def processes_before() -> set[int]:
    """This process's descendants once the fork server and resource tracker run (they are meant to stay)."""
    ResilientEnv.isolated(env_fn()).close()
    return descendants()


# --- an isolated env behaves as the env itself -------------------------------------------------------


def test_an_isolated_cartpole_resets_steps_and_closes_with_its_spaces_passed_through() -> None:
    local = gymnasium.make("CartPole-v1")
    env = ResilientEnv.isolated(CARTPOLE)
    worker = worker_of(env)
    assert worker.pid != os.getpid()
    assert env.observation_space == local.observation_space
    assert env.action_space == local.action_space
    assert env.metadata == local.metadata
    assert env.render_mode is None
    assert env.spec is not None
    assert env.spec.id == "CartPole-v1"
    assert env.spec.additional_wrappers[-1].name == "ResilientEnv"
    assert env.unwrapped is env.env  # the local stand-in: the real env lives in the worker
    stack = "TimeLimit<OrderEnforcing<PassiveEnvChecker<CartPoleEnv<CartPole-v1>>>>"
    assert repr(env.env) == f"<IsolatedEnv<{stack}> pid={worker.pid}>"

    observation, _ = env.reset(seed=0)
    expected, _ = local.reset(seed=0)
    np.testing.assert_array_equal(observation, expected)
    assert env.np_random.bit_generator.state == local.np_random.bit_generator.state
    for action in (0, 1, 1, 0):
        result = env.step(action)
        expected_result = local.step(action)
        np.testing.assert_array_equal(result[0], expected_result[0])
        assert result[1:] == expected_result[1:]
    env.close()
    local.close()
    assert env.closed
    assert not worker.is_running()


def test_a_text_env_renders_through_its_worker() -> None:
    env = ResilientEnv.isolated(functools.partial(ScriptableEnv, render_mode="ansi"))
    assert env.render_mode == "ansi"
    assert env.reset() == ("Say something.", {})
    env.step("ls -la")
    assert env.render() == "ls -la"
    env.close()


# --- deadlines ---------------------------------------------------------------------------------------


def test_a_step_that_hangs_is_killed_at_its_deadline_and_the_env_counts_as_closed() -> None:
    env = ResilientEnv.isolated(HANGING_STEP, step_timeout=0.5)
    worker = worker_of(env)
    env.reset()
    error, elapsed = timed(lambda: env.step("sleep forever"))
    assert isinstance(error, EnvTimeoutError)
    assert 0.5 <= elapsed < 0.5 + MARGIN_S
    assert str(error) == "env step exceeded its 0.5 s deadline"
    assert (error.operation, error.timeout_s) == ("step", 0.5)
    assert not psutil.pid_exists(worker.pid)
    assert env.closed
    with pytest.raises(EnvClosedError, match=r"^cannot step: the env is closed$"):
        env.step("again")
    env.close()  # a no-op: no error, nothing to close
    assert env.close_error is None


def ended(process: psutil.Process) -> bool:
    """Whether ``process`` is gone; orphans are reaped by init, not by us, so a zombie has ended too."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until_ended(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """The processes still running after up to ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not all(map(ended, processes)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [process for process in processes if not ended(process)]


def test_the_subprocesses_of_a_killed_worker_are_killed_with_it() -> None:
    spawn_then_hang = env_fn(Fault(kind="spawn", turn=0), Fault(kind="hang", turn=1))
    env = ResilientEnv.isolated(spawn_then_hang, step_timeout=0.5)
    env.reset()
    env.step("start the tool")
    [tool] = worker_of(env).children()
    with pytest.raises(EnvTimeoutError):
        env.step("hang")
    assert wait_until_ended([tool], timeout_s=5) == []


def test_a_daemon_an_isolated_env_started_ends_with_its_worker_at_close() -> None:
    """Double-forked into a session of its own, its parent gone: neither the worker's group nor its
    children, but the worker adopted it."""
    with session_sleeps(1) as marker:
        env = ResilientEnv.isolated(functools.partial(LeavingEnv, "daemon", marker))
        env.reset()
        env.step("start a daemon")
        assert wait_until(lambda: sleeping(marker)), "the daemon did not start"
        env.close()
        assert wait_until(lambda: not sleeping(marker)), f"left running: {sleeping(marker)}"


def test_a_reset_that_hangs_is_killed_at_its_deadline_and_the_env_counts_as_closed() -> None:
    env = ResilientEnv.isolated(HANGING_RESET, reset_timeout=0.5)
    worker = worker_of(env)
    error, elapsed = timed(env.reset)
    assert isinstance(error, EnvTimeoutError)
    assert 0.5 <= elapsed < 0.5 + MARGIN_S
    assert str(error) == "env reset exceeded its 0.5 s deadline"
    assert not worker.is_running()
    assert env.closed
    with pytest.raises(EnvClosedError, match=r"^cannot reset: the env is closed$"):
        env.reset()
    env.close()


def test_a_reset_past_its_deadline_is_not_retried_though_the_policy_retries_timeouts() -> None:
    slept: list[float] = []
    policy = RetryPolicy(attempts=3, retry_on=(TimeoutError, EnvClosedError), sleep=slept.append)
    env = ResilientEnv.isolated(HANGING_RESET, reset_timeout=0.3, reset_retry=policy)
    error, elapsed = timed(env.reset)
    assert isinstance(error, EnvTimeoutError)  # itself a TimeoutError: the policy would have retried it
    assert elapsed < 0.3 + MARGIN_S
    assert slept == []


def test_a_factory_that_hangs_is_killed_at_the_start_deadline() -> None:
    before = descendants()
    error, elapsed = timed(
        lambda: ResilientEnv.isolated(env_fn(Fault(kind="hang", phase="build")), start_timeout=0.5)
    )
    assert isinstance(error, EnvTimeoutError)
    assert str(error) == "env start exceeded its 0.5 s deadline"
    assert elapsed < 0.5 + MARGIN_S + 1.0  # the first start in a session also starts the fork server
    assert descendants() <= before | multiprocessing_helpers()


def test_close_kills_a_worker_whose_env_close_outlasts_close_timeout() -> None:
    env = ResilientEnv.isolated(HANGING_CLOSE, close_timeout=0.5)
    worker = worker_of(env)
    error, elapsed = timed(env.close)
    assert isinstance(error, EnvCloseError)
    assert isinstance(error.__cause__, EnvTimeoutError)
    assert str(error.__cause__) == "env close exceeded its 0.5 s deadline"
    assert elapsed < 0.5 + MARGIN_S
    assert not worker.is_running()
    env.close()


def test_close_from_another_thread_during_a_hanging_step_kills_the_worker_and_the_step_sees_it_closed() -> (
    None
):
    env = ResilientEnv.isolated(HANGING_STEP, close_timeout=0.3)
    worker = worker_of(env)
    env.reset()
    with ThreadPoolExecutor(1) as pool:
        step = pool.submit(env.step, "sleep forever")
        time.sleep(0.2)
        error, elapsed = timed(env.close)
        assert isinstance(step.exception(timeout=MARGIN_S), EnvClosedError)
    assert isinstance(error, EnvCloseError)  # the env's close never ran: the worker had to be killed
    assert str(error.__cause__) == "env close exceeded its 0.3 s deadline"
    assert elapsed < 0.3 + MARGIN_S
    assert not worker.is_running()


def test_a_keyboard_interrupt_while_waiting_kills_the_worker_and_propagates() -> None:
    env = ResilientEnv.isolated(HANGING_STEP)  # no deadline: only Ctrl-C ends it
    worker = worker_of(env)
    env.reset()
    main_thread = threading.main_thread().ident
    assert main_thread == threading.get_ident()
    # Python's own handler, which raises KeyboardInterrupt: a job a non-interactive shell started in
    # the background (a CI runner's `cmd &`) inherits SIGINT ignored, and a session event loop of an
    # earlier async test installs asyncio's, which only cancels that loop's main task.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.3, signal.pthread_kill, args=(main_thread, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            env.step("sleep forever")
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert env.closed
    assert not worker.is_running()


# --- a worker that dies ------------------------------------------------------------------------------


def test_a_worker_that_exits_mid_step_raises_env_worker_died_error_naming_the_exit_code() -> None:
    env = ResilientEnv.isolated(env_fn(Fault(kind="exit")))
    worker = worker_of(env)
    env.reset()
    with pytest.raises(EnvWorkerDiedError) as caught:
        env.step("segfault")
    assert str(caught.value) == "env worker process died during step (exit code 3)"
    assert (caught.value.operation, caught.value.exitcode) == ("step", 3)
    assert not worker.is_running()
    assert env.closed
    with pytest.raises(EnvClosedError):
        env.step("again")
    env.close()


def test_a_worker_killed_from_outside_between_calls_raises_env_worker_died_error() -> None:
    env = ResilientEnv.isolated(env_fn())
    worker = worker_of(env)
    env.reset()
    worker.kill()  # the OOM killer, say
    worker.wait(timeout=5)
    with pytest.raises(
        EnvWorkerDiedError, match=r"^env worker process died during step \(killed by SIGKILL\)$"
    ):
        env.step("hello")
    assert env.closed


def test_a_factory_that_raises_in_the_worker_raises_its_exception_and_leaves_no_worker() -> None:
    before = descendants() | multiprocessing_helpers()
    with pytest.raises(RuntimeError) as caught:
        ResilientEnv.isolated(
            env_fn(Fault(phase="build", error=RuntimeError, message="no container runtime"))
        )
    assert str(caught.value) == "no container runtime"
    assert any("in fire" in note for note in caught.value.__notes__)
    assert descendants() <= before | multiprocessing_helpers()


def test_an_isolated_factory_that_returns_no_env_raises_a_type_error_naming_it_and_leaves_no_worker() -> None:
    before = descendants() | multiprocessing_helpers()
    with pytest.raises(TypeError) as caught:
        ResilientEnv.isolated(functools.partial(dict, observation="hi"))  # type: ignore[arg-type]
    assert (
        str(caught.value)
        == "env factory dict returned {'observation': 'hi'} (of type dict), expected a gymnasium.Env"
    )
    assert any("raised in the env's worker process" in note for note in caught.value.__notes__)
    assert descendants() <= before | multiprocessing_helpers()


# --- no process left behind --------------------------------------------------------------------------


@pytest.mark.slow
def test_sixteen_isolated_envs_in_threads_with_one_hanging_all_finish_and_leave_no_process(
    processes_before: set[int],
) -> None:
    hanging, batch = 7, tasks(16)

    def rollout(index: int) -> object:
        faults = [Fault(kind="hang")] if index == hanging else []
        with ResilientEnv.isolated(env_fn(*faults, turns=5, task=batch[index]), step_timeout=2.0) as env:
            prompt, _ = env.reset(seed=index)
            for turn in range(5):
                observation, *_ = env.step(f"rollout {index} turn {turn}")
        return prompt, observation

    start = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(rollout, index) for index in range(16)]
        outcomes = [future.exception() or future.result() for future in futures]
    assert isinstance(outcomes[hanging], EnvTimeoutError)
    # Each env is its own task's, and took every step.
    assert outcomes[:hanging] + outcomes[hanging + 1 :] == [
        (batch[index].prompt, [{"role": "user", "content": "turn 5 done"}])
        for index in range(16)
        if index != hanging
    ]
    assert time.monotonic() - start < 30
    assert descendants() <= processes_before


def test_garbage_collection_of_an_unclosed_isolated_env_closes_its_worker() -> None:
    env = ResilientEnv.isolated(env_fn())
    worker = worker_of(env)
    env.reset()
    with pytest.warns(ResourceWarning, match=r"^unclosed ResilientEnv around <IsolatedEnv<CountingTextEnv"):
        del env
        gc.collect()
    assert not worker.is_running()


def test_garbage_collection_of_an_unclosed_bare_isolated_env_closes_its_worker() -> None:
    env = IsolatedEnv(env_fn())
    worker = psutil.Process(env.pid)
    with pytest.warns(
        ResourceWarning, match=rf"^unclosed IsolatedEnv \(worker pid {worker.pid}\) was closed"
    ):
        del env
        gc.collect()
    assert not worker.is_running()


def run_script(body: str, **popen: Any) -> subprocess.Popen[str]:
    script = f"import sys\nsys.path.insert(0, {TESTS!r})\n" + textwrap.dedent(body)
    return subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    )


@pytest.mark.slow
def test_interpreter_exit_with_unclosed_isolated_envs_closes_them_and_leaves_no_worker() -> None:
    child = run_script(
        """
        from doubles import Fault, env_fn
        from gym_resilience.backends.resilient import ResilientEnv

        envs = [
            ResilientEnv.isolated(env_fn(Fault(kind="print", phase="close", message="inner close ran"))),
            ResilientEnv.isolated(env_fn(Fault(kind="hang", phase="close")), close_timeout=0.5),
        ]
        for env in envs:
            env.reset()
        print(*(env.env.pid for env in envs), flush=True)
        """
    )
    stdout, stderr = child.communicate(timeout=60)
    assert child.returncode == 0, stderr
    pids, closed = stdout.splitlines()
    assert closed == "inner close ran"  # the healthy env was closed, not just killed
    for pid in map(int, pids.split()):
        assert not psutil.pid_exists(pid)


@pytest.mark.slow
def test_a_hung_worker_does_not_outlive_its_parent_killed_with_sigkill() -> None:
    child = run_script(
        """
        from doubles import Fault, env_fn
        from gym_resilience.backends.resilient import ResilientEnv

        env = ResilientEnv.isolated(env_fn(Fault(kind="hang")), close_timeout=0.5)
        env.reset()
        print(env.env.pid, flush=True)
        env.step("sleep forever")
        """
    )
    try:
        assert child.stdout is not None
        worker = psutil.Process(int(child.stdout.readline()))
        helpers = psutil.Process(child.pid).children(recursive=True)  # fork server, tracker, worker
        assert worker in helpers
    finally:
        child.kill()
        child.communicate(timeout=60)

    assert wait_until_ended(helpers, timeout_s=15) == []


@pytest.mark.slow
@pytest.mark.parametrize("worker_state", ["busy", "idle"])
def test_what_a_worker_started_does_not_outlive_its_parent_killed_while_it_is_busy_or_idle(
    worker_state: str,
) -> None:
    """Nobody kills the worker's group once the parent is gone: the worker does, after its grace period,
    so a tool the env started goes with it (a scheduler's SIGKILL of a training job, say)."""
    child = run_script(
        f"""
        import time
        from doubles import Fault, env_fn
        from gym_resilience.backends.resilient import ResilientEnv

        env = ResilientEnv.isolated(
            env_fn(Fault(kind="spawn", turn=0), Fault(kind="hang", turn=1)), close_timeout=0.5
        )
        env.reset()
        env.step("start the tool")
        print(env.env.pid, flush=True)
        if {worker_state!r} == "busy":
            env.step("hang")
        time.sleep(3600)
        """
    )
    try:
        assert child.stdout is not None
        worker = psutil.Process(int(child.stdout.readline()))
        [tool] = worker.children()
    finally:
        child.kill()
        child.communicate(timeout=60)
    assert wait_until_ended([worker, tool], timeout_s=15) == []


def test_an_env_that_leaves_a_thread_running_closes_at_once() -> None:
    """The worker exits as soon as it has answered the close, without waiting for the env's threads
    (an interpreter's normal exit would, until the parent's kill at close_timeout)."""
    env = ResilientEnv.isolated(env_fn(Fault(kind="thread", turn=0)), close_timeout=5)
    env.reset()
    env.step("start a thread")
    start = time.monotonic()
    env.close()
    assert time.monotonic() - start < MARGIN_S and env.close_error is None
    assert env.unwrapped._worker.exitcode == 0  # type: ignore[attr-defined]


@pytest.mark.slow
def test_workers_of_a_program_find_what_its_main_script_imports_already_imported(tmp_path: Path) -> None:
    # A training script imports torch or ray at its top; every worker used to import them again.
    (tmp_path / "heavy_dependency.py").write_text(
        "import os\nprint('heavy imported in', os.getpid(), flush=True)\n"
    )
    (tmp_path / "train.py").write_text(
        textwrap.dedent(
            """
            import heavy_dependency
            from gym_resilience.backends.process import IsolatedEnv
            from gym_resilience.testing import ScriptableEnv

            if __name__ == "__main__":
                for _ in range(3):
                    IsolatedEnv(ScriptableEnv).close()
                print("done", flush=True)
            """
        )
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    result = subprocess.run(
        [sys.executable, str(tmp_path / "train.py")],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    imports = [line for line in result.stdout.splitlines() if line.startswith("heavy imported in")]
    # Once in the program, once in the fork server, never in the three workers forked from it.
    assert len(imports) == 2, result.stdout
