"""Batches on the Ray env backend on a real 3-node Ray cluster (``ray_cluster``): factories that fail,
batches cancelled or failed, envs that leave state behind, a node removed mid-batch or while its actors
wait idle; each test checks that no env actor is left alive."""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path
from typing import Any

import pytest
from leaks import eventually
from pool_envs import leaving_env, leaving_tasks, session_sleeps, sleeping
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from ray_helpers import (
    GIVE_UP_S,
    HOST,
    assert_dead,
    assert_no_env_actor_alive,
    raise_value_error,
    remove_node,
    restore_nodes,
    wait_until,
)

from gym_resilience import (
    BatchRunner,
    EnvStepError,
    EnvWorkerDiedError,
    RetryPolicy,
    RunnerConfig,
    Task,
    validate_batch_output,
    without_timings,
)
from gym_resilience.backends.ray import DEFAULT_ACTOR_OPTIONS, _Actor
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.errors import root_cause
from gym_resilience.task_gen import generate_tasks, word_game_factory
from gym_resilience.testing import ScriptableEnv, echo_step
from harness.run.cluster import LocalCluster

pytestmark = pytest.mark.slow


# --- batches ---------------------------------------------------------------------------------------------


async def test_a_batch_on_ray_runs_real_envs_on_the_node_its_actor_options_pin(
    ray_cluster: LocalCluster,
) -> None:
    node_id = ray_cluster.worker_node_ids()[-1]
    before = {record.actor_id for record in ray_cluster.actors(HOST)}
    config = RunnerConfig(
        max_turns=2,
        env_backend="ray",
        env_actor_options={"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)},
        env_step_timeout_s=30.0,
    )
    tasks = generate_tasks(4, seed=0, max_turns=2)
    async with BatchRunner(ScriptedEngine(), word_game_factory, config) as runner:
        result = await runner.generate(tasks)
    threaded = await BatchRunner(ScriptedEngine(), word_game_factory, RunnerConfig(max_turns=2)).generate(
        tasks
    )
    # The same episodes as in threads, token for token.
    assert [without_timings(t) for t in result.trajectories] == [
        without_timings(t) for t in threaded.trajectories
    ]
    validate_batch_output(result.output, len(tasks))
    made = [record for record in ray_cluster.actors(HOST) if record.actor_id not in before]
    assert [record.node_id for record in made] == [node_id] * len(tasks)
    assert_dead(ray_cluster, *(record.actor_id for record in made))


def failing_for_task_2(task: Task) -> ScriptableEnv:
    return ScriptableEnv(step=raise_value_error if task.instance_id == "t2" else echo_step)


def plain_tasks(n: int) -> list[Task]:
    return [Task(prompt=[{"role": "user", "content": f"task {i}"}], instance_id=f"t{i}") for i in range(n)]


def returns(value: Any, task: Task) -> Any:
    """An env factory that returns ``value``."""
    return value


class ClosableNotAnEnv:
    """Something with a ``close()`` that is no env: each close is a line in ``path``, on any node."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __repr__(self) -> str:
        return "ClosableNotAnEnv()"

    def close(self) -> None:
        with open(self.path, "a", encoding="utf-8") as file:
            file.write("closed\n")


async def test_a_factory_that_returns_no_env_fails_with_the_threads_type_error_and_leaves_no_actor(
    ray_cluster: LocalCluster, tmp_path: Path
) -> None:
    before = {record.actor_id for record in ray_cluster.actors(HOST)}
    seen: dict[str, list[tuple[type[BaseException], str, str]]] = {"thread": [], "ray": []}
    for backend, failures in seen.items():
        closes = tmp_path / f"{backend}.closes"
        for returned in (None, ClosableNotAnEnv(str(closes))):
            config = RunnerConfig(max_turns=1, env_backend=backend)  # type: ignore[arg-type]
            async with BatchRunner(ScriptedEngine(), functools.partial(returns, returned), config) as runner:
                with pytest.raises(TypeError) as caught:
                    await runner.generate(plain_tasks(1))
            assert root_cause(caught.value) is caught.value
            failures.append(
                (type(caught.value), str(caught.value), closes.read_text() if closes.exists() else "")
            )
    assert (
        seen["ray"]
        == seen["thread"]
        == [
            (TypeError, f"env factory {__name__}.returns returned None, expected a gymnasium.Env", ""),
            (
                TypeError,
                f"env factory {__name__}.returns returned ClosableNotAnEnv() "
                f"(of type {__name__}.ClosableNotAnEnv), expected a gymnasium.Env",
                "closed\n",
            ),
        ]
    )
    made = {record.actor_id for record in ray_cluster.actors(HOST)} - before
    assert len(made) == 2
    assert_dead(ray_cluster, *made)


async def test_a_failed_batch_leaves_no_env_actor_alive(ray_cluster: LocalCluster) -> None:
    config = RunnerConfig(max_turns=2, env_backend="ray")
    async with BatchRunner(ScriptedEngine(delay_s=0.2), failing_for_task_2, config) as runner:
        with pytest.raises(EnvStepError):
            await runner.generate(plain_tasks(4))
    assert_no_env_actor_alive(ray_cluster)


@pytest.mark.parametrize("leave", ["session", "daemon"])
@pytest.mark.parametrize("reuse", [True, False], ids=["retired", "one env per actor"])
async def test_a_process_an_env_started_in_a_session_of_its_own_ends_with_its_actor(
    ray_cluster: LocalCluster, reuse: bool, leave: str
) -> None:
    """Ray ends what its killed worker processes started (sessions of their own included): an actor
    retired for what its env left, or after its one env, leaves nothing running; a daemon (double-forked
    into a session of its own) too, which the actor adopted."""
    config = RunnerConfig(env_backend="ray", max_concurrency=1, env_workers=1, env_worker_reuse=reuse)
    with session_sleeps(10 * len(leave) + reuse) as marker:
        async with BatchRunner(ScriptedEngine(), leaving_env, config) as runner:
            result = await runner.generate(leaving_tasks(leave, "", marker=marker))
            assert not result.failures, result.failures
            assert await eventually(lambda: not sleeping(marker)), f"left running: {sleeping(marker)}"
    assert_no_env_actor_alive(ray_cluster)


async def test_one_actor_serves_clean_envs_one_after_another_though_ray_opens_files_in_it(
    ray_cluster: LocalCluster,
) -> None:
    """Ray's runtime opens connections in an actor's process as it goes: open files are not what an
    actor's env is judged by, or nearly every actor would be retired after its first env."""
    config = RunnerConfig(env_backend="ray", max_concurrency=1, env_workers=1)
    async with BatchRunner(ScriptedEngine(), leaving_env, config) as runner:
        result = await runner.generate(leaving_tasks(*[""] * 8))
        assert not result.failures, result.failures
        assert len({trajectory.env_metrics["pid"] for trajectory in result.trajectories}) == 1  # type: ignore[union-attr]
        assert runner.env_workers is not None and runner.env_workers.stats.retired == 0
    assert_no_env_actor_alive(ray_cluster)


@pytest.mark.parametrize(("leave", "seen"), [("alarm", "alarm_s"), ("resource limit", "open_files_limit")])
async def test_an_actor_whose_env_left_process_state_behind_is_replaced_and_the_next_env_sees_none_of_it(
    ray_cluster: LocalCluster, leave: str, seen: str
) -> None:
    config = RunnerConfig(env_backend="ray", max_concurrency=1, env_workers=1)
    async with BatchRunner(ScriptedEngine(), leaving_env, config) as runner:
        result = await runner.generate(leaving_tasks(leave, "", ""))
        assert not result.failures, result.failures
        first, second, third = [trajectory.env_metrics for trajectory in result.trajectories]  # type: ignore[union-attr]
        assert first["pid"] != second["pid"] == third["pid"]
        assert second[seen] == first[seen]  # the first reported before it left anything
    assert_no_env_actor_alive(ray_cluster)


def slow_env(task: Task) -> ScriptableEnv:
    return ScriptableEnv(step=slow_echo)


def slow_echo(env: ScriptableEnv, action: Any) -> Any:
    time.sleep(0.5)
    return echo_step(env, action)


async def test_a_batch_cancelled_mid_flight_leaves_no_env_actor_alive(ray_cluster: LocalCluster) -> None:
    config = RunnerConfig(max_turns=20, env_backend="ray")
    async with BatchRunner(ScriptedEngine(), slow_env, config) as runner:
        batch = asyncio.ensure_future(runner.generate(plain_tasks(4)))
        await asyncio.to_thread(wait_until, lambda: len(ray_cluster.alive_actors(HOST)) >= 2, "envs started")
        batch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await batch
    assert_no_env_actor_alive(ray_cluster)


async def test_a_worker_node_removed_mid_batch_costs_no_rollout_and_leaves_no_actor(
    ray_cluster: LocalCluster,
) -> None:
    victim = ray_cluster.worker_node_ids()[0]
    config = RunnerConfig(
        skip_failed_rollouts=True,
        max_turns=6,
        env_backend="ray",
        env_actor_options={"scheduling_strategy": "SPREAD"},
        retry=RetryPolicy(attempts=3, initial_delay_s=0.0, jitter_s=0.1, retry_on=(EnvWorkerDiedError,)),
    )
    tasks = plain_tasks(32)
    runner = BatchRunner(ScriptedEngine(), slow_env, config)
    batch = asyncio.ensure_future(runner.generate(tasks))

    def on_victim() -> int:
        return sum(r.node_id == victim and r.state == "ALIVE" for r in ray_cluster.actors(HOST))

    try:
        await asyncio.to_thread(wait_until, lambda: on_victim() >= 3, "envs running on the victim node")
        await remove_node(ray_cluster, victim)
        result = await asyncio.wait_for(batch, timeout=GIVE_UP_S * 3)
        # The actors left serve the next batch; none of them is on the lost node.
        alive = {r.actor_id: r.node_id for r in ray_cluster.actors(HOST) if r.state == "ALIVE"}
        assert victim not in alive.values()
        again = await runner.generate(plain_tasks(8))
        assert not again.failures
    finally:
        await runner.close()
        restore_nodes(ray_cluster, victim)
    assert len(result.trajectories) == len(tasks)
    validate_batch_output(result.output, len(tasks))
    assert result.metrics["retries/rollouts"] >= 1  # the removal did hit rollouts in flight
    for failure in result.failures:
        assert isinstance(failure.exception, EnvWorkerDiedError)
        assert victim in str(failure.exception)
    assert_no_env_actor_alive(ray_cluster)


async def test_idle_actors_lost_with_their_node_are_replaced_without_failing_the_next_rollout(
    ray_cluster: LocalCluster,
) -> None:
    victim = ray_cluster.worker_node_ids()[0]
    config = RunnerConfig(
        skip_failed_rollouts=True,
        max_turns=2,
        max_concurrency=8,
        env_workers=12,
        env_workers_prestart=True,
        env_backend="ray",
        # On the victim while it lives (Ray may place some elsewhere), elsewhere once it is gone.
        env_actor_options={"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=victim, soft=True)},
    )
    runner = BatchRunner(ScriptedEngine(), lambda task: ScriptableEnv(), config)
    try:
        assert not (await runner.generate(plain_tasks(8))).failures
        workers = runner.env_workers
        assert workers is not None
        # Four more idle actors, surely on the victim, which serve no env before its loss (prestarted,
        # they have not said where they are).
        start = workers._start
        pinned = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=victim, soft=False)}
        workers._start = lambda: _Actor.create({**DEFAULT_ACTOR_OPTIONS, **pinned}, reuse=True)
        try:
            await asyncio.to_thread(workers.prestart, 12)
        finally:
            workers._start = start

        def on_victim() -> set[str]:
            records = ray_cluster.actors(HOST)
            return {r.actor_id for r in records if r.node_id == victim and r.state == "ALIVE"}

        prestarted = {worker.actor_id for worker in workers._idle if worker.node_id is None}
        assert len(prestarted) == 4
        # Started, so that the loss takes running actors (one lost before it started is the unit tests').
        await asyncio.to_thread(wait_until, lambda: prestarted <= on_victim(), "the pinned actors alive")
        # The node's actors on top of the idle ones, those that served no env on the very top.
        workers._idle.sort(key=lambda worker: (worker.actor_id in on_victim(), worker.node_id is None))
        assert all(worker.actor_id in on_victim() for worker in workers._idle[-4:])
        await remove_node(ray_cluster, victim)
        result = await runner.generate(plain_tasks(1))  # no retry: the rollout has one attempt
        assert not result.failures, result.failures
        [attempt] = result.attempts
        assert attempt.node_id != victim
    finally:
        await runner.close()
        restore_nodes(ray_cluster, victim)
    assert_no_env_actor_alive(ray_cluster)
