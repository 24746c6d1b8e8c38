"""skyrl-gym environments under ``BatchRunner``, with every guarantee of ``ResilientEnv``.

A skyrl-gym env speaks its own protocol: ``init(prompt) -> (messages, metadata)``,
``step(text) -> {"observations", "reward", "done", "metadata"}`` and ``close()``. ``SkyRLGymEnv`` turns it
into the Gymnasium text env the runner drives, and ``skyrl_gym_factory`` builds one per rollout, so the
runner wraps it in a ``ResilientEnv`` like any other env: its failures become ``EnvResetError`` /
``EnvStepError`` / ``EnvCloseError`` with the env's exception as ``__cause__``, it is closed exactly once,
and with ``isolate_envs=True`` it runs in its own worker process (the factory pickles).

skyrl-gym comes with the ``[skyrl]`` extra (``pip install 'gym-resilience[skyrl]'``); without it,
``skyrl_gym_factory`` raises ``DependencyNotInstalledError`` naming that extra. This module imports
without it.

Example:
    >>> from gym_resilience import Task
    >>> factory = skyrl_gym_factory("gsm8k")
    >>> task = Task(
    ...     prompt=[{"role": "user", "content": "What is 6 x 7?"}],
    ...     instance_id="q1",
    ...     env_kwargs={"reward_spec": {"ground_truth": "42"}},
    ... )
    >>> env = factory(task)
    >>> env.reset()[0]
    [{'role': 'user', 'content': 'What is 6 x 7?'}]
    >>> env.step("6 x 7 = 42. #### 42")[1:4]
    (1.0, True, False)
    >>> env.close()
"""

from __future__ import annotations

import copy
import importlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Final

import gymnasium
from gymnasium.envs.registration import EnvSpec

from gym_resilience.envs.word_game import ChatMessages, reply_space
from gym_resilience.errors import (
    BrokenDependencyError,
    DependencyNotInstalledError,
    EnvClosedError,
    UnsupportedConfigError,
    describe_exception,
)
from gym_resilience.tasks import ChatMessage, Task

__all__ = ["SkyRLGymEnv", "SkyRLGymFactory", "skyrl_gym_factory"]

_EXTRA: Final = "'gym-resilience[skyrl]'"

_STEP_KEYS: Final = ("observations", "reward", "done")
"""What a skyrl-gym step result must hold; ``metadata`` may be missing or None."""


def _import(name: str) -> ModuleType:
    """``name`` (skyrl_gym, or a module it brings), imported; typed errors when it is missing or broken."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name.split(".")[0] and exc.name != name:
            raise BrokenDependencyError(
                packages=["skyrl-gym"], reason=describe_exception(exc), fix=f"pip install {_EXTRA}"
            ) from exc
        raise DependencyNotInstalledError(package="skyrl-gym", extra=_EXTRA) from exc
    except ImportError as exc:
        raise BrokenDependencyError(
            packages=["skyrl-gym"], reason=describe_exception(exc), fix=f"pip install {_EXTRA}"
        ) from exc


def _env_config(config: Any) -> Any:
    """The config handed to the env. SkyRL hands each env its section of its config, an OmegaConf
    ``DictConfig``; a mapping becomes one here, so envs that read attributes (text2sql's
    ``env_config.db_path``) work with a plain dict."""
    if config is None:
        config = {}
    if isinstance(config, Mapping):
        return _import("omegaconf").OmegaConf.create(dict(config))
    return config


def _init_result(result: object) -> tuple[Any, dict[str, Any]]:
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(f"a skyrl-gym env's init must return (observations, metadata), got {result!r:.80}")
    observations, metadata = result
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(f"a skyrl-gym env's init returned metadata of type {type(metadata).__name__}")
    return observations, dict(metadata or {})


def _step_result(result: object) -> tuple[Any, Any, Any, dict[str, Any]]:
    """``(observations, reward, done, metadata)`` of a step; reward and done are checked by the runner."""
    if not isinstance(result, Mapping):
        raise TypeError(
            "a skyrl-gym env's step must return a dict with observations, reward and done, "
            f"got {type(result).__name__}: {result!r:.80}"
        )
    missing = [key for key in _STEP_KEYS if key not in result]
    if missing:
        raise TypeError(
            f"a skyrl-gym env's step returned a dict without {', '.join(missing)}: {result!r:.80}"
        )
    metadata = result.get("metadata")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(f"a skyrl-gym env's step returned metadata of type {type(metadata).__name__}")
    return result["observations"], result["reward"], result["done"], dict(metadata or {})


class SkyRLGymEnv(gymnasium.Env[list[ChatMessage], str]):
    """One skyrl-gym env as a Gymnasium text env.

    ``reset`` calls the env's ``init`` with a copy of the prompt and returns what it returns. ``step``
    maps the env's dict to ``(observations, reward, done, False, info)``: ``terminated`` is the env's
    ``done`` and ``truncated`` is always False (a skyrl-gym env ends an episode at its own turn limit
    with ``done``). ``info`` is the step's ``metadata`` updated with the env's ``get_metrics()``, so the
    last step's numeric values become the trajectory's ``env_metrics``, as SkyRL's generator reads
    ``get_metrics()`` at the end of the episode. ``close`` closes the env. A second ``reset`` closes the
    env and builds it anew: a skyrl-gym env holds one episode. Every env it builds is closed exactly once,
    whatever fails (its close, a rebuild, ``init``); once closed, ``reset`` and ``step`` raise
    ``EnvClosedError``.

    Args:
        skyrl_spec: The env's skyrl-gym ``EnvSpec`` (``skyrl_gym.spec(env_id)``).
        prompt: The opening chat messages, handed to ``init``.
        extras: The env's ``extras`` (a SkyRL dataset row's ``env_extras``); copied for each build.
        env_config: The env's section of SkyRL's ``skyrl_gym`` config; a mapping becomes a ``DictConfig``.
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 (Gymnasium's class attribute)

    def __init__(
        self,
        skyrl_spec: Any,
        *,
        prompt: Sequence[ChatMessage],
        extras: Mapping[str, Any],
        env_config: Any = None,
    ) -> None:
        self.observation_space = ChatMessages()
        self.action_space = reply_space()
        # skyrl-gym takes any id; Gymnasium's spec takes word characters, ':', '.' and '-' only.
        self._env_id = "skyrl_gym/" + re.sub(r"[^\w:.-]", "_", str(skyrl_spec.id))
        self.spec = EnvSpec(id=self._env_id)
        self._skyrl_spec = skyrl_spec
        self._prompt = [dict(message) for message in prompt]
        self._extras = dict(extras)
        self._env_config = env_config
        self._started = False
        self._closed = False
        self.env: Any = self._build()
        """The skyrl-gym env of the current episode; None once closed, or when a reset failed to build one."""

    def _build(self) -> Any:
        # Deep copies: envs may edit their extras, and every repetition of a task shares them.
        return _import("skyrl_gym").make(
            self._skyrl_spec, env_config=_env_config(self._env_config), extras=copy.deepcopy(self._extras)
        )

    def _current(self, operation: str) -> Any:
        """The skyrl-gym env to run ``operation`` on."""
        if self._closed:
            raise EnvClosedError(operation=operation, env_id=self._env_id)
        if self.env is None:
            raise RuntimeError(f"cannot {operation}: the last reset failed before it built a skyrl-gym env")
        return self.env

    def _release(self) -> None:
        """Closes the current skyrl-gym env, letting go of it first: every env it built is closed once,
        even when its close raises (it then counts as closed), or a close or a build comes after."""
        env, self.env = self.env, None
        if env is not None:
            env.close()

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[ChatMessage], dict[str, Any]]:
        if self._closed:
            raise EnvClosedError(operation="reset", env_id=self._env_id)
        super().reset(seed=seed)
        if self._started:
            self._release()
            self.env = self._build()
        self._started = True
        observations, metadata = _init_result(self.env.init(copy.deepcopy(self._prompt)))
        return observations, metadata

    def step(self, action: str) -> tuple[list[ChatMessage], Any, Any, bool, dict[str, Any]]:
        env = self._current("step")
        observations, reward, done, info = _step_result(env.step(action))
        get_metrics = getattr(env, "get_metrics", None)
        if callable(get_metrics):
            info.update(get_metrics())
        return observations, reward, done, False, info

    def close(self) -> None:
        """Closes the skyrl-gym env, once: later calls, and a close after a failed reset, close nothing
        twice."""
        self._closed = True
        self._release()


@dataclass(frozen=True)
class SkyRLGymFactory:
    """An ``EnvFactory`` that builds one ``SkyRLGymEnv`` per rollout from a ``Task``.

    The task's ``prompt`` goes to ``init`` and its ``env_kwargs`` are the env's ``extras``. It pickles
    (the env's skyrl-gym spec travels with it), so ``isolate_envs=True`` can build the env in a worker.
    """

    skyrl_spec: Any
    env_config: Any = None

    @property
    def env_id(self) -> str:
        return str(self.skyrl_spec.id)

    def __call__(self, task: Task) -> SkyRLGymEnv:
        return SkyRLGymEnv(
            self.skyrl_spec, prompt=task.prompt, extras=task.env_kwargs, env_config=self.env_config
        )


def skyrl_gym_factory(env_id: str, env_config: Any = None) -> SkyRLGymFactory:
    """An env factory for ``BatchRunner`` that builds the registered skyrl-gym env ``env_id`` per rollout.

    The task's ``env_kwargs`` become skyrl-gym's ``extras``, what a SkyRL dataset row's ``env_extras``
    hold (gsm8k: ``{"reward_spec": {"ground_truth": "42"}}``). SkyRL's generator also puts its own
    ``max_turns`` into every env's extras; here put ``"max_turns"`` in ``env_kwargs`` for the envs that
    read it (``gsm8k_multi_turn`` requires it, ``text2sql`` defaults to 5), and keep
    ``RunnerConfig.max_turns`` at least as large. ``env_config`` is the env's section of SkyRL's
    ``skyrl_gym`` config (text2sql: ``{"db_path": ...}``); a mapping becomes an OmegaConf ``DictConfig``
    as in SkyRL.

    Raises:
        DependencyNotInstalledError: skyrl-gym is not installed (install the ``[skyrl]`` extra).
        BrokenDependencyError: skyrl-gym is installed but fails to import.
        UnsupportedConfigError: no skyrl-gym env is registered as ``env_id``.
    """
    registry = _import("skyrl_gym").registry
    skyrl_spec = registry.get(env_id) if isinstance(env_id, str) else None
    if skyrl_spec is None:
        known = ", ".join(sorted(registry))
        raise UnsupportedConfigError(
            f"no skyrl-gym env is registered as {env_id!r}; registered: {known}", option="env_id"
        )
    return SkyRLGymFactory(copy.deepcopy(skyrl_spec), env_config)
