"""Test doubles that ship with the library, in the spirit of Gymnasium's ``GenericTestEnv``.

:class:`ScriptableEnv` is a text env whose ``reset``/``step``/``close`` are callables you pass in, and which
counts its calls; :func:`flaky` makes any such callable raise on chosen calls::

    env = ScriptableEnv(step=flaky(echo_step, ConnectionError("tool server went away"), calls={2}))
"""

from __future__ import annotations

import functools
import string
from collections.abc import Callable, Container
from typing import Any, ParamSpec, SupportsFloat, TypeVar

import gymnasium
from gymnasium import spaces

__all__ = [
    "TEXT_CHARSET",
    "ScriptableEnv",
    "default_reset",
    "echo_step",
    "flaky",
    "text_space",
]

TEXT_CHARSET = string.printable
"""The characters of the default text spaces: printable ASCII, whitespace included."""

ResetFn = Callable[["ScriptableEnv", int | None, dict[str, Any] | None], tuple[Any, dict[str, Any]]]
"""``reset(env, seed, options) -> (observation, info)``."""
StepFn = Callable[["ScriptableEnv", Any], tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]]
"""``step(env, action) -> (observation, reward, terminated, truncated, info)``."""
CloseFn = Callable[["ScriptableEnv"], None]
"""``close(env) -> None``."""

P = ParamSpec("P")
R = TypeVar("R")


def text_space(max_length: int = 4096) -> spaces.Text:
    """A text space of printable ASCII strings, empty ones included."""
    return spaces.Text(max_length, min_length=0, charset=TEXT_CHARSET)


def default_reset(
    env: ScriptableEnv, seed: int | None, options: dict[str, Any] | None
) -> tuple[str, dict[str, Any]]:
    """Reset behaviour: a fixed prompt."""
    return "Say something.", {}


def echo_step(env: ScriptableEnv, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
    """Step behaviour: the observation is the action, the reward 0.0, and the episode never ends."""
    return action, 0.0, False, False, {}


def _no_op_close(env: ScriptableEnv) -> None:
    return None


def flaky(
    behaviour: Callable[P, R], error: BaseException | Callable[[], BaseException], *, calls: Container[int]
) -> Callable[P, R]:
    """``behaviour``, except that its calls numbered in ``calls`` (0-based) raise ``error`` instead.

    ``error`` is an exception instance (raised as it is, the same object every time) or a factory such
    as an exception class (a fresh exception per failing call). ``calls=range(2)`` fails the first two
    calls, ``calls={2}`` only the third.
    """
    count = 0

    @functools.wraps(behaviour)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> R:
        nonlocal count
        index = count
        count += 1
        if index in calls:
            raise error if isinstance(error, BaseException) else error()
        return behaviour(*args, **kwargs)

    return wrapped


class ScriptableEnv(gymnasium.Env[Any, Any]):
    """A text env whose behaviours are callables, and which counts how it was called.

    Observations and actions are strings by default (:func:`text_space`); ``reset`` returns a prompt and
    ``step`` echoes the action. Pass ``reset``/``step``/``close`` to script failures, delays or
    termination; each receives the env first, so it can read :attr:`turn` or the counters.

    Args:
        reset: ``reset(env, seed, options) -> (observation, info)``.
        step: ``step(env, action) -> (observation, reward, terminated, truncated, info)``.
        close: ``close(env) -> None``.
        observation_space: Defaults to :func:`text_space`.
        action_space: Defaults to :func:`text_space`.
        render_mode: None or ``"ansi"`` (renders the last observation).

    Attributes:
        reset_calls: ``reset`` calls so far, failed ones included.
        step_calls: ``step`` calls so far, failed ones included.
        close_calls: ``close`` calls so far, failed ones included.
        turn: Steps completed since the last completed reset.

    Example:
        >>> env = ScriptableEnv()
        >>> env.reset(seed=0)
        ('Say something.', {})
        >>> env.step("hello")
        ('hello', 0.0, False, False, {})
        >>> env.close()
        >>> env.reset_calls, env.step_calls, env.close_calls
        (1, 1, 1)
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi"], "render_fps": 4}  # noqa: RUF012 (Gymnasium's API)

    def __init__(
        self,
        *,
        reset: ResetFn = default_reset,
        step: StepFn = echo_step,
        close: CloseFn = _no_op_close,
        observation_space: spaces.Space[Any] | None = None,
        action_space: spaces.Space[Any] | None = None,
        render_mode: str | None = None,
    ) -> None:
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self._reset = reset
        self._step = step
        self._close = close
        self.observation_space = observation_space if observation_space is not None else text_space()
        self.action_space = action_space if action_space is not None else text_space()
        self.render_mode = render_mode
        self.reset_calls = 0
        self.step_calls = 0
        self.close_calls = 0
        self.turn = 0
        self._last_observation: Any = None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Runs the reset behaviour; seeds ``np_random`` first."""
        self.reset_calls += 1
        super().reset(seed=seed)
        observation, info = self._reset(self, seed, options)
        self.turn = 0
        self._last_observation = observation
        return observation, info

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        """Runs the step behaviour."""
        self.step_calls += 1
        result = self._step(self, action)
        self.turn += 1
        self._last_observation = result[0]
        return result

    def render(self) -> str | None:
        """The last observation as text in ``"ansi"`` mode, else None."""
        if self.render_mode != "ansi":
            return None
        return "" if self._last_observation is None else str(self._last_observation)

    def close(self) -> None:
        """Runs the close behaviour."""
        self.close_calls += 1
        self._close(self)
