"""A multi-turn word-guessing game (hangman without the gallows) for text agents.

Why this game: every turn scores the reply, so a policy that writes nonsense still earns something
now and then (its first new letter is sometimes in the word), which gives an RL batch varying rewards
even from a random-weight model. The turn rewards of one episode sum to the fraction of the word
revealed, so a solved episode is worth exactly 1.0.

This module also holds the pieces both bundled envs share: the ``ChatMessages`` observation space and
the episode state machine.
"""

from __future__ import annotations

import enum
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any, Final

import gymnasium
from gymnasium import spaces
from gymnasium.error import ClosedEnvironmentError, ResetNeeded

from gym_resilience.tasks import ChatMessage, Task

__all__ = ["ROLES", "WORDS", "ChatMessages", "EpisodeState", "WordGameEnv", "reply_space"]

ROLES: Final = ("system", "user", "assistant", "tool")

WORDS: Final = (
    "apple", "bridge", "candle", "dragon", "engine", "forest", "garden", "harbor", "island", "jacket",
    "kettle", "lemon", "marble", "needle", "orange", "pencil", "quartz", "rabbit", "silver", "tunnel",
    "velvet", "window", "yellow", "zebra", "anchor", "basket", "castle", "dinner", "falcon", "guitar",
)  # fmt: skip
"""Secrets drawn when neither the constructor nor the task names one."""

MAX_REPLY_CHARS: Final = 4096


def reply_space() -> spaces.Text:
    """The action space of the bundled envs: one reply of the agent.

    ``step`` accepts any ``str``; the space's printable-ASCII charset only bounds what ``sample()`` draws.
    """
    return spaces.Text(max_length=MAX_REPLY_CHARS, min_length=0, charset=string.printable)


class ChatMessages(spaces.Space[list[ChatMessage]]):
    """A list of chat messages, each ``{"role": ..., "content": ...}`` with a known role.

    Why a custom space: the observation really is a variable-length list of messages of free text,
    and no built-in space contains exactly that (``Sequence`` of ``Dict`` holds tuples, ``Text`` a
    fixed charset), so ``obs in env.observation_space`` is only true with a space that says so.
    """

    def __init__(self, max_messages: int = 64, seed: int | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)
        self.max_messages = max_messages
        self._content = spaces.Text(max_length=64, min_length=0, charset=string.printable)

    def sample(self, mask: Any | None = None, probability: Any | None = None) -> list[ChatMessage]:
        """Draw one to three messages of random printable text."""
        if mask is not None or probability is not None:
            raise ValueError("ChatMessages.sample() takes no mask or probability")
        count = int(self.np_random.integers(1, 4))
        self._content.seed(int(self.np_random.integers(2**31)))
        roles = self.np_random.choice(len(ROLES), size=count)
        return [{"role": ROLES[int(r)], "content": self._content.sample()} for r in roles]

    def contains(self, x: Any) -> bool:
        """True for a list (at most ``max_messages`` long) of role/content string dicts."""
        return (
            isinstance(x, list)
            and len(x) <= self.max_messages
            and all(
                isinstance(m, dict)
                and m.keys() == {"role", "content"}
                and m["role"] in ROLES
                and isinstance(m["content"], str)
                for m in x
            )
        )

    def __repr__(self) -> str:
        return f"ChatMessages(max_messages={self.max_messages})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChatMessages) and other.max_messages == self.max_messages

    __hash__ = None  # type: ignore[assignment]


class EpisodeState(enum.Enum):
    """Where an env is in its life: stepping is only valid while ``RUNNING``."""

    NEEDS_RESET = "needs_reset"
    RUNNING = "running"
    DONE = "done"
    CLOSED = "closed"


def check_can_step(state: EpisodeState) -> None:
    """Raise the gymnasium error that says why ``step`` is not valid now."""
    if state is EpisodeState.CLOSED:
        raise ClosedEnvironmentError("step() called on a closed environment")
    if state is EpisodeState.NEEDS_RESET:
        raise ResetNeeded("call reset() before step()")
    if state is EpisodeState.DONE:
        raise ResetNeeded("the episode has ended: call reset() before step()")


def task_from_options(options: Mapping[str, Any] | None) -> Task | None:
    """The ``Task`` passed as ``options={"task": task}``, or None."""
    task = (options or {}).get("task")
    if task is not None and not isinstance(task, Task):
        raise TypeError(f"options['task'] must be a Task, got {type(task).__name__}")
    return task


def opening_messages(prompt: Sequence[ChatMessage], addendum: str) -> list[ChatMessage]:
    """Fresh copies of ``prompt`` with ``addendum`` appended to its last user message.

    Appending instead of adding a message keeps user and assistant turns alternating, which strict
    chat templates require.
    """
    messages = [dict(m) for m in prompt]
    if messages and messages[-1]["role"] == "user":
        messages[-1]["content"] = f"{messages[-1]['content']}\n\n{addendum}"
    else:
        messages.append({"role": "user", "content": addendum})
    return messages


def _check_secret(secret: str) -> str:
    if not (secret and secret.isascii() and secret.isalpha() and secret.islower()):
        raise ValueError(f"the secret must be lowercase ASCII letters, got {secret!r}")
    return secret


class WordGameEnv(gymnasium.Env[list[ChatMessage], str]):
    """Guess a secret word one letter per turn, or all at once.

    The guess of a turn is the whole word if the reply contains it as a word (case-insensitive), else
    the first ASCII letter of the reply not guessed before. Reward per turn: the fraction of the word's
    positions that the guess newly reveals. ``terminated`` once the word is fully revealed;
    ``truncated`` after ``max_turns`` turns without that.

    ``reset`` returns the opening chat messages (the task's prompt, or a default one, with the board
    appended); ``step`` returns one user message with the hint. The secret comes from, in order, the
    task's ``env_kwargs["secret"]``, the constructor, or ``WORDS`` drawn with the reset seed.

    Example:
        >>> env = WordGameEnv(secret="cab", max_turns=4)
        >>> messages, info = env.reset(seed=0)
        >>> env.step("I guess the word is cab")[1:3]
        (1.0, True)
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 - gymnasium's own annotation

    def __init__(self, secret: str | None = None, *, max_turns: int = 8) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        self._default_secret = None if secret is None else _check_secret(secret)
        self._default_max_turns = max_turns
        self.observation_space = ChatMessages()
        self.action_space = reply_space()
        self._state = EpisodeState.NEEDS_RESET
        self._secret = ""
        self._max_turns = max_turns
        self._guessed: set[str] = set()
        self._turn = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[ChatMessage], dict[str, Any]]:
        """Start an episode; ``options={"task": task}`` supplies the prompt and may name the secret."""
        if self._state is EpisodeState.CLOSED:
            raise ClosedEnvironmentError("reset() called on a closed environment")
        super().reset(seed=seed)
        task = task_from_options(options)
        kwargs = task.env_kwargs if task is not None else {}
        secret = kwargs.get("secret", self._default_secret)
        if secret is None:
            secret = WORDS[int(self.np_random.integers(len(WORDS)))]
        self._secret = _check_secret(secret)
        self._max_turns = int(kwargs.get("max_turns", self._default_max_turns))
        self._guessed = set()
        self._turn = 0
        self._state = EpisodeState.RUNNING
        prompt = task.prompt if task is not None else self._default_prompt()
        board = f"Word: {self._board()} ({len(self._secret)} letters, {self._max_turns} turns)."
        return opening_messages(prompt, board), {"max_turns": self._max_turns}

    def step(self, action: str) -> tuple[list[ChatMessage], float, bool, bool, dict[str, Any]]:
        """Score one reply; returns one hint message, the turn's reward, and the episode flags."""
        check_can_step(self._state)
        if not isinstance(action, str):
            raise TypeError(f"the action must be a str, got {type(action).__name__}")
        self._turn += 1
        hidden_before = self._hidden()
        guess = self._parse_guess(action)
        if guess is not None:
            self._guessed.update(self._secret if guess == self._secret else guess)
        revealed = hidden_before - self._hidden()
        reward = revealed / len(self._secret)
        terminated = self._hidden() == 0
        truncated = not terminated and self._turn >= self._max_turns
        if terminated or truncated:
            self._state = EpisodeState.DONE
        hint = self._hint(guess, revealed, terminated, truncated)
        info = {"turn": self._turn, "guess": guess, "board": self._board(), "solved": terminated}
        return [{"role": "user", "content": hint}], reward, terminated, truncated, info

    def close(self) -> None:
        """Nothing to release; later calls raise ``ClosedEnvironmentError``."""
        self._state = EpisodeState.CLOSED

    def _parse_guess(self, reply: str) -> str | None:
        lowered = reply.lower()
        if re.search(rf"\b{self._secret}\b", lowered):
            return self._secret
        return next(
            (c for c in lowered if c in string.ascii_lowercase and c not in self._guessed),
            None,
        )

    def _hidden(self) -> int:
        return sum(c not in self._guessed for c in self._secret)

    def _board(self) -> str:
        return " ".join(c if c in self._guessed else "_" for c in self._secret)

    def _hint(self, guess: str | None, revealed: int, terminated: bool, truncated: bool) -> str:
        if guess is None:
            verdict = "I found no new letter in your reply."
        elif guess == self._secret:
            verdict = f"Yes, the word is '{self._secret}'."
        elif revealed:
            verdict = f"Yes, '{guess}' is in the word."
        else:
            verdict = f"No '{guess}' in the word."
        if terminated:
            return f"{verdict} Solved: {self._board()}."
        if truncated:
            return f"{verdict} Out of turns; the word was '{self._secret}'."
        left = self._max_turns - self._turn
        return f"{verdict} Word: {self._board()} ({left} turns left)."

    def _default_prompt(self) -> list[ChatMessage]:
        return [
            {"role": "system", "content": "You are playing a word-guessing game."},
            {
                "role": "user",
                "content": "Guess my secret word. Reply with one letter per turn, or the whole word.",
            },
        ]
