"""Seeded tasks for the bundled envs, and the env factories a batch runner takes.

Why faker: prompts that read like real requests (names, companies, cities) give the chat template and
tokenizer realistic input, while a seed makes every batch replayable: the same seed gives the same
tasks, so a chaos run can be compared with its fault-free baseline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, get_args

import gymnasium

from gym_resilience.envs import TOOL_USE_ID, WORD_GAME_ID
from gym_resilience.errors import DependencyNotInstalledError
from gym_resilience.tasks import ChatMessage, Task

if TYPE_CHECKING:
    from faker import Faker

__all__ = ["EnvName", "ToolEnvFactory", "generate_tasks", "tool_env_factory", "word_game_factory"]

EnvName = Literal["word_game", "tool_use"]

_FAKER_EXTRA: Final = "'gym-resilience[chaos]' (the vllm-cpu and vllm extras include faker too)"

_ITEMS: Final = (
    "printer cartridges", "office chairs", "laptops", "coffee mugs", "safety helmets", "desk lamps",
    "shipping boxes", "notebooks", "monitors", "pallets of paper",
)  # fmt: skip


def generate_tasks(
    n: int, *, seed: int, env: EnvName = "word_game", max_turns: int | None = None
) -> list[Task]:
    """``n`` tasks for ``env``, identical for the same seed, with ids ``"{env}-{seed}-{index:04d}"``.

    Each prompt is a system and a user message; ``env_kwargs`` holds what the env's constructor
    takes (``secret`` or ``target``, and ``max_turns``: 8 for the word game, 4 for tool use, unless
    given). Uses its own seeded ``Faker``: the global ``random`` state is left alone.

    Raises:
        ValueError: ``n`` or ``seed`` is not an int, ``n`` is negative, ``max_turns`` is not an int
            >= 1, or ``env`` is not one of the bundled envs.
        DependencyNotInstalledError: faker is not installed (it is not a core dependency).
    """
    for name, value in (("n", n), ("seed", seed)):
        if not _is_int(value):
            raise ValueError(f"{name} must be an int, got {value!r}")  # a None seed would not replay
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    if max_turns is not None and not (_is_int(max_turns) and max_turns >= 1):
        raise ValueError(f"max_turns must be None or an int >= 1, got {max_turns!r}")
    if env not in get_args(EnvName):
        raise ValueError(f"env must be one of {get_args(EnvName)}, got {env!r}")
    fake = _faker(seed)
    make = _word_game_task if env == "word_game" else _tool_use_task
    turns = max_turns if max_turns is not None else 8 if env == "word_game" else 4
    return [make(fake, f"{env}-{seed}-{index:04d}", turns) for index in range(n)]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _faker(seed: int) -> Faker:
    try:
        from faker import Faker
    except ImportError as exc:  # not a core dependency: the extras that run the bundled envs bring it
        raise DependencyNotInstalledError(package="faker", extra=_FAKER_EXTRA) from exc
    fake = Faker("en_US")
    fake.seed_instance(seed)
    return fake


def _word_game_task(fake: Faker, instance_id: str, max_turns: int) -> Task:
    secret = _secret_word(fake)
    host = fake.first_name()
    opener = fake.random_element(
        (
            f"Hi, I'm {host} from {fake.city()}. I'm thinking of a {len(secret)}-letter word.",
            f"{host} here. My secret word has {len(secret)} letters. Can you find it?",
            f"Let's play! {host} picked a {len(secret)}-letter word for you to guess.",
        )
    )
    prompt: list[ChatMessage] = [
        {
            "role": "system",
            "content": f"You are a friendly assistant at {fake.company()} playing a word-guessing game.",
        },
        {
            "role": "user",
            "content": f"{opener} Each turn, reply with one letter, or the whole word if you know it. "
            f"You have {max_turns} turns.",
        },
    ]
    return Task(prompt=prompt, instance_id=instance_id, env_kwargs={"secret": secret, "max_turns": max_turns})


def _secret_word(fake: Faker) -> str:
    """A lowercase ASCII word of 4 to 8 letters; faker's word list also holds "PM" and "ok"."""
    while True:
        word: str = fake.word()
        if word.isascii() and word.isalpha() and word.islower() and 4 <= len(word) <= 8:
            return word


def _tool_use_task(fake: Faker, instance_id: str, max_turns: int) -> Task:
    name, company, city = fake.name(), fake.company(), fake.city()
    item: str = fake.random_element(_ITEMS)
    op: str = fake.random_element(("+", "-", "*"))
    a, b = fake.random_int(20, 999), fake.random_int(2, 99)
    if op == "*":
        question, target = (
            f"{name} at {company} orders {b} {item} at ${a} each. What is the total in dollars?",
            a * b,
        )
    elif op == "+":
        question, target = f"The {city} warehouse holds {a} {item}. A delivery adds {b}. How many now?", a + b
    else:
        question, target = (
            f"{name} had {a} {item} in stock in {city} and shipped {b}. How many are left?",
            a - b,
        )
    prompt: list[ChatMessage] = [
        {
            "role": "system",
            "content": f"You are an operations assistant at {company}. You have a calculator tool: write "
            "an arithmetic expression such as `12 * 7` and the tool returns its value. The task is "
            "solved when the calculator returns the right answer.",
        },
        {"role": "user", "content": question},
    ]
    return Task(prompt=prompt, instance_id=instance_id, env_kwargs={"target": target, "max_turns": max_turns})


def word_game_factory(task: Task) -> gymnasium.Env[list[ChatMessage], str]:
    """The env of one word-game rollout, built with ``gymnasium.make`` from the task's ``env_kwargs``.

    The passive env checker is off: it only re-checks on the first calls what the tests check.
    """
    env: gymnasium.Env[list[ChatMessage], str] = gymnasium.make(
        WORD_GAME_ID, disable_env_checker=True, **task.env_kwargs
    )
    return env


@dataclass(frozen=True, slots=True)
class ToolEnvFactory:
    """Builds tool-use envs that call ``tool_url``; a picklable object, so isolated (subprocess) envs work."""

    tool_url: str
    timeout: float | None = 5.0

    def __call__(self, task: Task) -> gymnasium.Env[list[ChatMessage], str]:
        kwargs: dict[str, Any] = {**task.env_kwargs, "tool_url": self.tool_url, "timeout": self.timeout}
        env: gymnasium.Env[list[ChatMessage], str] = gymnasium.make(
            TOOL_USE_ID, disable_env_checker=True, **kwargs
        )
        return env


def tool_env_factory(
    tool_url: str, *, timeout: float | None = 5.0
) -> Callable[[Task], gymnasium.Env[Any, Any]]:
    """An ``env_factory`` for tool-use tasks against the tool server at ``tool_url``."""
    return ToolEnvFactory(tool_url, timeout)
