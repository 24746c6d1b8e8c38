"""RunnerConfig: a configuration that cannot work is refused when it is made, naming the option."""

from __future__ import annotations

import pytest

from gym_resilience import RetryPolicy, RunnerConfig, UnsupportedConfigError


def test_each_rollout_is_seeded_with_the_seed_plus_its_index_and_samples_with_it() -> None:
    config = RunnerConfig(seed=10, max_tokens=32, logprobs=True)
    assert config.rollout_seed(3) == 13
    assert RunnerConfig(seed=None).rollout_seed(3) is None
    sampling = config.sampling(3)
    assert (sampling.seed, sampling.max_tokens, sampling.logprobs) == (13, 32, True)


def test_an_env_deadline_without_a_process_to_kill_is_refused() -> None:
    with pytest.raises(UnsupportedConfigError) as caught:
        RunnerConfig(env_step_timeout_s=5.0)
    assert caught.value.option == "env_step_timeout_s"
    assert RunnerConfig(env_step_timeout_s=5.0, env_backend="process").env_step_timeout_s == 5.0


def test_isolate_envs_selects_the_process_backend_and_refuses_ray() -> None:
    assert RunnerConfig(isolate_envs=True).env_backend == "process"
    with pytest.raises(UnsupportedConfigError, match="set only one"):
        RunnerConfig(isolate_envs=True, env_backend="ray")


def test_an_int_given_for_a_float_field_becomes_a_float_and_a_wrong_type_is_refused() -> None:
    config = RunnerConfig(temperature=1)
    assert type(config.temperature) is float
    with pytest.raises(UnsupportedConfigError) as caught:
        RunnerConfig(max_turns="3")  # type: ignore[arg-type]
    assert caught.value.option == "max_turns"


def test_plain_data_builds_the_same_config_and_names_the_path_of_a_bad_value() -> None:
    config = RunnerConfig.from_mapping({"max_turns": 3, "retry": {"attempts": 2}})
    assert config.max_turns == 3 and config.retry == RetryPolicy(attempts=2)
    with pytest.raises(UnsupportedConfigError) as caught:
        RunnerConfig.from_mapping({"retry": {"attempts": 0}})
    assert str(caught.value) == "runner.retry.attempts: must be an int >= 1, got 0"


@pytest.mark.parametrize(
    ("options", "option"),
    [
        ({"max_failed_fraction": 0.5}, "max_failed_fraction"),
        ({"top_p": 0.0}, "top_p"),
        ({"batched": True, "max_turns": 2}, "batched"),
        ({"env_actor_options": {"num_cpus": 1}}, "env_actor_options"),
    ],
)
def test_combinations_that_cannot_work_name_the_option(options: dict[str, object], option: str) -> None:
    with pytest.raises(UnsupportedConfigError) as caught:
        RunnerConfig(**options)  # type: ignore[arg-type]
    assert caught.value.option == option
