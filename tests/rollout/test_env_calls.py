"""EnvCalls: how a rollout's env is called and closed, as the BackendEnv that make_env returned says."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from doubles import tasks

from gym_resilience import ResilientEnv, RunnerConfig
from gym_resilience.backends.choice import BackendEnv, make_env
from gym_resilience.backends.protocol import WorkerEnv
from gym_resilience.errors import EnvError
from gym_resilience.rollout.env_calls import EnvCalls, LateCloses
from gym_resilience.rollout.open_envs import OpenEnvs
from gym_resilience.rollout.pool import EnvPool
from gym_resilience.rollout.progress import Progress
from gym_resilience.testing import ScriptableEnv


class _Worker(WorkerEnv):
    """A WorkerEnv that only reports a node: enough for BackendEnv to read it."""

    def __init__(self, node_id: object) -> None:
        self.node_id = node_id

    @property
    def lost(self) -> EnvError | None:
        return None

    @property
    def closed(self) -> bool:
        return False


def test_the_thread_backend_gives_a_local_env_wrapping_what_the_factory_built() -> None:
    built = ScriptableEnv()
    env = make_env(lambda task: built, tasks(1)[0], RunnerConfig())
    assert (env.remote, env.worker, env.node_id) == (False, None, None)
    assert env.env.unwrapped is built
    env.env.close()
    assert built.close_calls == 1


def test_a_factory_that_returns_a_resilient_env_is_not_wrapped_again() -> None:
    wrapped = ResilientEnv(ScriptableEnv())
    env = make_env(lambda task: wrapped, tasks(1)[0], RunnerConfig())
    assert env.env is wrapped and not env.remote
    wrapped.close()


def test_the_node_of_a_backend_env_is_its_workers_node_when_that_is_a_string() -> None:
    inner = ResilientEnv(ScriptableEnv())
    assert BackendEnv(inner, remote=True, worker=_Worker("node-7")).node_id == "node-7"
    assert BackendEnv(inner, remote=True, worker=_Worker(None)).node_id is None
    assert BackendEnv(inner, remote=False).node_id is None
    inner.close()


def test_late_closes_name_how_many_envs_were_left_to_their_threads() -> None:
    late = LateCloses(timeout_s=2.0)
    quiet = RuntimeError("batch failed")
    late.note(quiet)
    assert not getattr(quiet, "__notes__", [])
    late.count = 2
    error = RuntimeError("batch failed")
    late.note(error)
    assert error.__notes__ == [
        "2 envs were still being built or closed when the batch stopped waiting for them "
        "(close_timeout_s=2): the thread of each closes it when its call returns"
    ]


async def test_a_local_envs_close_waits_for_its_call_in_flight_and_a_remote_envs_does_not() -> None:
    pool = EnvPool(threads=2, name="test-env-calls")
    release = threading.Event()
    order: list[str] = []

    def stuck(name: str) -> None:
        release.wait(10)
        order.append(f"{name} call")

    def closing(name: str) -> Any:
        def close(env: ScriptableEnv) -> None:
            order.append(f"{name} close")

        return close

    try:
        for name, remote in (("local", False), ("remote", True)):
            calls = EnvCalls(pool, Progress(rollout_index=0), OpenEnvs())
            env = BackendEnv(ResilientEnv(ScriptableEnv(close=closing(name))), remote=remote)
            call = calls.submit(stuck, name)
            closed = calls.close(env)
            assert calls.close(env) is closed  # queued once
            if remote:
                await closed  # beside the stuck call, on a thread of its own
                assert order == [f"{name} close"]
            release.set()
            await call
            await closed
            release.clear()
            if not remote:
                assert order == ["local call", "local close"]
                order.clear()
    finally:
        release.set()
        pool.shutdown()


def test_how_an_env_is_called_is_decided_once_a_backend_env_cannot_be_changed() -> None:
    env = BackendEnv(ResilientEnv(ScriptableEnv()), remote=False)
    with pytest.raises(AttributeError):
        env.remote = True  # type: ignore[misc]
    env.env.close()
