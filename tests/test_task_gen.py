"""The seeded task generator and the env factories built on it."""

from __future__ import annotations

import pickle
import random
import re
from collections.abc import Iterator

import pytest

from gym_resilience.envs import ToolServer
from gym_resilience.task_gen import EnvName, generate_tasks, tool_env_factory, word_game_factory

ENVS: list[EnvName] = ["word_game", "tool_use"]


@pytest.fixture(scope="module")
def tool_server() -> Iterator[ToolServer]:
    with ToolServer() as server:
        yield server


@pytest.mark.parametrize("env", ENVS)
def test_the_same_seed_gives_the_same_tasks_and_another_seed_other_tasks(env: EnvName) -> None:
    assert generate_tasks(20, seed=5, env=env) == generate_tasks(20, seed=5, env=env)
    first, other = generate_tasks(20, seed=5, env=env), generate_tasks(20, seed=6, env=env)
    assert [t.prompt for t in first] != [t.prompt for t in other]


@pytest.mark.parametrize("env", ENVS)
def test_instance_ids_are_unique_and_name_env_seed_and_index(env: EnvName) -> None:
    tasks = generate_tasks(300, seed=1, env=env)
    assert len({t.instance_id for t in tasks}) == 300
    assert tasks[7].instance_id == f"{env}-1-0007"


@pytest.mark.parametrize("env", ENVS)
def test_prompts_are_a_system_then_a_user_chat_message(env: EnvName) -> None:
    for task in generate_tasks(50, seed=2, env=env):
        assert [m["role"] for m in task.prompt] == ["system", "user"]
        for message in task.prompt:
            assert set(message) == {"role", "content"}
            assert isinstance(message["content"], str) and message["content"].strip()


def test_word_game_tasks_hold_a_lowercase_secret_and_the_turn_limit() -> None:
    for task in generate_tasks(100, seed=3, env="word_game", max_turns=5):
        secret = task.env_kwargs["secret"]
        assert secret.isascii() and secret.isalpha() and secret.islower() and 4 <= len(secret) <= 8
        assert task.env_kwargs["max_turns"] == 5
        assert (
            f"{len(secret)}-letter" in task.prompt[1]["content"]
            or f"{len(secret)} letters" in (task.prompt[1]["content"])
        )


def test_generating_tasks_leaves_the_global_random_state_alone() -> None:
    state = random.getstate()
    generate_tasks(10, seed=4, env="tool_use")
    assert random.getstate() == state


def test_bad_arguments_are_rejected_and_zero_tasks_is_empty() -> None:
    assert generate_tasks(0, seed=0) == []
    with pytest.raises(ValueError, match="n must be non-negative, got -1"):
        generate_tasks(-1, seed=0)
    with pytest.raises(ValueError, match="env must be one of"):
        generate_tasks(1, seed=0, env="chess")  # type: ignore[arg-type]


def test_word_game_factory_builds_an_env_the_secret_solves() -> None:
    task = generate_tasks(1, seed=9, env="word_game")[0]
    env = word_game_factory(task)
    messages, _ = env.reset(seed=0, options={"task": task})
    assert messages[0] == task.prompt[0]
    assert messages[1]["content"].startswith(task.prompt[1]["content"])
    assert env.step(task.env_kwargs["secret"])[1:3] == (1.0, True)
    env.close()


def test_tool_env_factory_builds_envs_that_reach_the_target_through_the_server(
    tool_server: ToolServer,
) -> None:
    factory = pickle.loads(pickle.dumps(tool_env_factory(tool_server.url, timeout=2.0)))
    for task in generate_tasks(5, seed=11, env="tool_use"):
        env = factory(task)
        messages, _ = env.reset(seed=0, options={"task": task})
        assert messages[1] == task.prompt[1]
        _, reward, terminated, _, info = env.step(f"The answer is {task.env_kwargs['target']}")
        assert (reward, terminated) == (1.0, True), info
        env.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 3, "seed": None}, "seed must be an int, got None"),
        ({"n": "3", "seed": 1}, "n must be an int, got '3'"),
        ({"n": 2.5, "seed": 1}, "n must be an int, got 2.5"),
        ({"n": -1, "seed": 1}, "n must be non-negative, got -1"),
        ({"n": 3, "seed": 1, "max_turns": 0}, "max_turns must be None or an int >= 1, got 0"),
        ({"n": 3, "seed": 1, "max_turns": True}, "max_turns must be None or an int >= 1, got True"),
    ],
)
def test_bad_arguments_are_a_value_error_naming_them(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        generate_tasks(**kwargs)  # type: ignore[arg-type]
