"""Env actor options that Ray refuses are refused once, before any rollout, as an
:class:`UnsupportedConfigError` naming ``env_actor_options`` with Ray's reason: Ray's own check, which needs
no cluster, runs where the runner's pool of actors (or a ``RayEnv`` of its own) is made. What Ray checks
only when it creates an actor (a ``scheduling_strategy`` string) fails each rollout with the same error."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from leaks import eventually
from pool_envs import leaving_env, leaving_tasks

from gym_resilience import AllRolloutsFailedError, BatchRunner, RunnerConfig, UnsupportedConfigError
from gym_resilience.backends.ray import RayEnv, ray_workers
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.testing import ScriptableEnv

if TYPE_CHECKING:
    from harness.run.cluster import LocalCluster

REFUSED_BY_RAY = [
    ({"num_cpus": -1}, "The quantity of resource num_cpus cannot be negative"),
    ({"bogus_option": 1}, "Invalid option keyword bogus_option for actors. Valid ones are ["),
    ({"num_cpus": "1"}, "The type of keyword 'num_cpus' must be "),
    ({"runtime_env": {"env_vars": {"A": 1}}}, "runtime_env['env_vars'] must be of type Dict[str, str]"),
]


def ray_config(options: dict[str, Any], **settings: Any) -> RunnerConfig:
    return RunnerConfig(env_backend="ray", env_actor_options=options, **settings)


@pytest.mark.parametrize(("options", "reason"), REFUSED_BY_RAY)
@pytest.mark.parametrize("reuse", [True, False], ids=["pooled", "one env per actor"])
async def test_options_ray_refuses_fail_the_batch_before_any_rollout_naming_env_actor_options(
    options: dict[str, Any], reason: str, reuse: bool
) -> None:
    """No cluster: the batch fails where it makes its actors' pool, before it needs one."""
    runner = BatchRunner(ScriptedEngine(), leaving_env, ray_config(options, env_worker_reuse=reuse))
    with pytest.raises(UnsupportedConfigError) as caught:
        await runner.generate(leaving_tasks("", ""))
    assert caught.value.option == "env_actor_options"
    assert str(caught.value).startswith(f"env_actor_options: Ray refused them: {reason}"), caught.value
    assert isinstance(caught.value.__cause__, ValueError | TypeError)  # Ray's own error
    assert runner.env_workers is None  # no pool, so no actor: nothing to close
    await runner.close()


@pytest.mark.parametrize(("options", "reason"), REFUSED_BY_RAY)
def test_options_ray_refuses_are_refused_by_a_pool_and_by_a_ray_env_of_its_own(
    options: dict[str, Any], reason: str
) -> None:
    for make in (
        lambda: ray_workers(options, size=2, reuse=True),
        lambda: RayEnv(ScriptableEnv, actor_options=options),
    ):
        with pytest.raises(UnsupportedConfigError, match=r"^env_actor_options: Ray refused them: ") as caught:
            make()
        assert reason in str(caught.value)


def test_options_ray_accepts_make_a_pool() -> None:
    pool = ray_workers({"num_cpus": 0.5, "scheduling_strategy": "SPREAD"}, size=2, reuse=True)
    assert pool.stats.started == 0  # nothing starts before an env needs an actor
    pool.close()


@pytest.mark.slow
async def test_a_scheduling_strategy_ray_checks_only_at_an_actors_creation_fails_each_rollout_naming_it(
    ray_cluster: LocalCluster,
) -> None:
    config = ray_config({"scheduling_strategy": "NOPE"}, skip_failed_rollouts=True)
    async with BatchRunner(ScriptedEngine(), leaving_env, config) as runner:
        with pytest.raises(AllRolloutsFailedError) as caught:
            await runner.generate(leaving_tasks("", ""))
    error = caught.value.__cause__
    assert isinstance(error, UnsupportedConfigError) and error.option == "env_actor_options", caught.value
    assert str(error).startswith(
        "env_actor_options: Ray refused them: Invalid scheduling_strategy value NOPE"
    )
    assert await eventually(lambda: not ray_cluster.alive_actors("_EnvHost"))
