"""The remote-call protocol of envs that live out of this process (a worker process, a Ray actor).

:class:`WorkerEnv` is what :class:`~gym_resilience.backends.resilient.ResilientEnv` and the batch runner
know of such an env: a call past its deadline ends the worker, a lost worker makes the env count as closed
(:attr:`WorkerEnv.lost` says why), and ``close`` may run beside a stuck call. :class:`RemoteEnv` turns the
Gymnasium API into requests to a :class:`Host` (the parent's handle on a worker or an actor), once for
every backend.

A request and its reply are pickled bytes, strictly alternating. Requests are ``(command, payload)``:

- ``("reset", {"seed": ..., "options": ...})``: ``env.reset(seed=..., options=...)``;
- ``("step", action)``: ``env.step(action)``;
- ``("render", None)``: ``env.render()``;
- ``("getattr", (name, on_unwrapped))``: ``getattr(env.unwrapped if on_unwrapped else env, name)``;
- ``("setattr", (name, value, on_unwrapped))``: the same for ``setattr``;
- ``("close", None)``: ``env.close()``.

Replies are ``("ok", value)`` or ``("raised", pickled exception or None, type name, str, traceback, why it
did not pickle)``. A host serves one env after another: each starts with ``("open", env_fn)``, answered
once the factory built the env with ``("ok", description)`` (spaces, metadata, render mode, spec, name) or
``("raised", ...)``. The replies to ``open`` and ``close`` come with a verdict, ``(reply, verdict)`` pickled:
None, or what the env (or its failed build) left behind in the host
(:class:`~gym_resilience.backends.baseline.WorkerBaseline`), which retires the host.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import pickle
import reprlib
import threading
import traceback
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any, Protocol, SupportsFloat

import gymnasium
import numpy as np
from gymnasium.core import RenderFrame

from gym_resilience.backends.baseline import WorkerBaseline
from gym_resilience.errors import EnvError, UnpicklableEnvError, describe_exception, exception_message

__all__ = [
    "CLOSE_REQUEST",
    "DEFAULT_CLOSE_TIMEOUT_S",
    "EnvFn",
    "Host",
    "Killable",
    "RemoteEnv",
    "StartAbort",
    "WorkerEnv",
    "answer_ending",
    "answer_open",
    "answer_request",
    "build_env",
    "checked_env",
    "open_env",
    "open_request",
    "unpack_ending",
    "unpack_reply",
]

DEFAULT_CLOSE_TIMEOUT_S = 5.0
"""How long ``close()`` waits for an isolated env to close before killing its worker."""

EnvFn = Callable[[], gymnasium.Env[Any, Any]]
"""A picklable zero-argument callable that builds the env, called once in the worker."""


class Killable(Protocol):
    """Something a caller can end at once from another thread: a worker process, an actor."""

    def kill(self) -> None: ...


class Host(Killable, Protocol):
    """The parent's handle on the worker or actor that holds one env."""

    @property
    def lost(self) -> EnvError | None: ...

    @property
    def running(self) -> bool: ...

    def request(self, command: str, payload: Any, *, operation: str, timeout: float | None) -> Any: ...

    def close(self) -> None: ...


# --- the host's side ---------------------------------------------------------------------------------


def _type_name(error: BaseException) -> str:
    cls = type(error)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _raised_reply(error: BaseException) -> tuple[Any, ...]:
    text = "".join(traceback.format_exception(error))
    blob: bytes | None = None
    reason = ""
    try:
        pickled = pickle.dumps(error)
        # A custom __init__ pickles fine and fails only when unpickled: find out here, not in the parent.
        pickle.loads(pickled)
        blob = pickled
    except Exception as exc:
        reason = describe_exception(exc)
    # A broken __str__ must not hide the error it belongs to: exception_message never raises.
    return ("raised", blob, _type_name(error), exception_message(error), text, reason)


def _describe(env: gymnasium.Env[Any, Any]) -> dict[str, Any]:
    spec = env.spec
    try:
        pickle.dumps(spec)
    except Exception:  # kwargs the parent could not receive (a lambda): it simply has no spec
        spec = None
    return {
        "observation_space": env.observation_space,
        "action_space": env.action_space,
        "metadata": env.metadata,
        "render_mode": env.render_mode,
        "spec": spec,
        "name": str(env),
    }


def _run(env: gymnasium.Env[Any, Any], command: str, payload: Any) -> Any:
    if command == "step":
        return env.step(payload)
    if command == "reset":
        return env.reset(**payload)
    if command == "render":
        return env.render()
    if command == "close":
        return env.close()
    if command == "getattr":
        name, on_unwrapped = payload
        return getattr(env.unwrapped if on_unwrapped else env, name)
    if command == "setattr":
        name, value, on_unwrapped = payload
        return setattr(env.unwrapped if on_unwrapped else env, name, value)
    raise ValueError(f"unknown command {command!r}")


_value_repr = reprlib.Repr()
_value_repr.maxstring = _value_repr.maxother = 80


def _qualified_name(named: object) -> str:
    """``module.qualname`` of a class or function (``qualname`` alone for a builtin); the main script is
    ``__main__`` in a worker process too (where multiprocessing imports it as ``__mp_main__``)."""
    module = getattr(named, "__module__", None)
    if module == "__mp_main__":
        module = "__main__"
    name = getattr(named, "__qualname__", None) or getattr(named, "__name__", "?")
    return str(name) if module in (None, "builtins") else f"{module}.{name}"


def _factory_name(factory: object) -> str:
    """The factory's qualified name, the same in every process: a partial's function (a backend that
    builds the env elsewhere binds the task with one), a callable object's type."""
    while isinstance(factory, functools.partial):
        factory = factory.func
    try:
        if isinstance(factory, type) or isinstance(getattr(factory, "__qualname__", None), str):
            return _qualified_name(factory)
    except Exception:  # a hostile __getattr__
        pass
    return f"{_qualified_name(type(factory))} object"


def _describe_value(value: object) -> str:
    """What a factory returned instead of an env, and what was expected."""
    if value is None:
        return "None, expected a gymnasium.Env"
    if isinstance(value, type):
        instance = " (an instance of it)" if issubclass(value, gymnasium.Env) else ""
        return f"the class {_qualified_name(value)}, expected a gymnasium.Env{instance}"
    try:
        shown = _value_repr.repr(value)
    except Exception:  # reprlib survives most broken reprs, not all
        shown = "<unprintable>"
    return f"{shown} (of type {_qualified_name(type(value))}), expected a gymnasium.Env"


def checked_env(value: object, factory: object) -> gymnasium.Env[Any, Any]:
    """``value``, what ``factory`` returned, if it is an env: the one check of every backend's envs.

    Raises:
        TypeError: ``value`` is no ``gymnasium.Env``; the message names ``factory`` and ``value``. A
            ``value`` with a ``close()`` (not a class) was closed first; a failure of that close is a note.
    """
    if isinstance(value, gymnasium.Env):
        return value
    error = TypeError(f"env factory {_factory_name(factory)} returned {_describe_value(value)}")
    if not isinstance(value, type):  # a class's close is a function that wants an instance
        try:
            close = getattr(value, "close", None)
            if callable(close):
                close()
        except Exception as close_error:
            error.add_note(
                f"closing what the env factory returned also failed: {describe_exception(close_error)}"
            )
    raise error


_last_described: list[tuple[dict[str, Any], bytes]] = []
"""The last description this host sent and its reply: a worker that serves one factory's envs sends the
same description each time, and pickling spaces (a ``Text`` space's character tables) costs more than the
rest of a cheap env's rollout."""


def _unseeded(description: dict[str, Any]) -> bool:
    """Whether the spaces have no random generator yet (a seeded one's state would differ from env to env,
    and equality does not compare it)."""
    spaces = (description["observation_space"], description["action_space"])
    return all(getattr(space, "_np_random", None) is None for space in spaces)


def _described(description: dict[str, Any]) -> bytes:
    """The ``("ok", description)`` reply, pickled, or the last one again if it describes the same env."""
    if _last_described and _unseeded(description):
        last, reply = _last_described[0]
        try:
            if last == description:
                return reply
        except Exception:  # spaces whose comparison fails: pickle this one
            pass
    reply = bytes(ForkingPickler.dumps(("ok", description)))
    _last_described[:] = [(description, reply)] if _unseeded(description) else []
    return reply


def build_env(env_fn: EnvFn) -> tuple[gymnasium.Env[Any, Any] | None, bytes]:
    """Builds the env where it will live: the env and the ``("ok", description)`` reply, or None and the
    ``("raised", ...)`` reply saying what ``env_fn`` raised, or that it returned no env (see
    :func:`checked_env`; an env it built is closed when describing it fails)."""
    env: gymnasium.Env[Any, Any] | None = None
    try:
        env = checked_env(env_fn(), env_fn)
        return env, _described(_describe(env))
    except BaseException as exc:
        if env is not None:
            with contextlib.suppress(Exception):
                env.close()
        return None, bytes(ForkingPickler.dumps(_raised_reply(exc)))


def answer_request(env: gymnasium.Env[Any, Any], data: bytes) -> tuple[bytes, str]:
    """Runs one pickled request on ``env``: the pickled reply, and the command (``close`` ends the host)."""
    command = ""
    try:
        command, payload = pickle.loads(data)
        value = _run(env, command, payload)
    except BaseException as exc:  # KeyboardInterrupt too: the parent re-raises it, as in-process
        return bytes(ForkingPickler.dumps(_raised_reply(exc))), command
    try:
        return bytes(ForkingPickler.dumps(("ok", value))), command
    except Exception as exc:  # the value does not pickle: that is the call's failure
        return bytes(ForkingPickler.dumps(_raised_reply(exc))), command


def _with_verdict(reply: bytes, baseline: WorkerBaseline | None) -> bytes:
    verdict = baseline.changes() if baseline is not None else None
    return bytes(ForkingPickler.dumps((reply, verdict)))


def answer_open(data: bytes, baseline: WorkerBaseline | None) -> tuple[gymnasium.Env[Any, Any] | None, bytes]:
    """Builds the env an ``open`` request asks for: the env (None if its build failed) and the reply with
    its verdict (``baseline``: the host's, if it serves more envs; else None). A built env's verdict is
    None: it is judged at its close."""
    _, env_fn = pickle.loads(data)
    return open_env(env_fn, baseline)


def open_env(env_fn: EnvFn, baseline: WorkerBaseline | None) -> tuple[gymnasium.Env[Any, Any] | None, bytes]:
    """:func:`answer_open` for a factory that arrived unpickled (a Ray actor's argument)."""
    env, reply = build_env(env_fn)
    return env, _with_verdict(reply, baseline if env is None else None)


def answer_ending(
    env: gymnasium.Env[Any, Any], data: bytes, baseline: WorkerBaseline | None
) -> tuple[bytes, bool]:
    """:func:`answer_request`, the reply to ``close`` with its verdict; and whether the env is closed."""
    reply, command = answer_request(env, data)
    if command != "close":
        return reply, False
    return _with_verdict(reply, baseline), True


# --- the caller's side -------------------------------------------------------------------------------


def open_request(env_fn: EnvFn) -> bytes:
    """The pickled ``open`` request of ``env_fn`` (raises what pickling it raises)."""
    return bytes(ForkingPickler.dumps(("open", env_fn)))


def unpack_ending(data: bytes) -> tuple[bytes, str | None]:
    """The reply and the verdict of a reply to ``open`` or ``close``."""
    reply, verdict = pickle.loads(data)
    return reply, verdict


def unpack_reply(data: bytes, *, where: str, env_id: str | None) -> Any:
    """The value of an ``ok`` reply from ``where`` (the env's host); raises the exception of a ``raised``
    reply, as itself with the host's traceback as a note, or as :class:`UnpicklableEnvError`."""
    try:
        reply = pickle.loads(data)
    except Exception as exc:
        exc.add_note(f"while unpickling the reply of {where}")
        raise
    if reply[0] == "ok":
        return reply[1]
    _, blob, type_name, message, text, reason = reply
    error: BaseException | None = None
    if blob is not None:
        try:
            error = pickle.loads(blob)
        except Exception as exc:  # its class is not importable here
            reason = describe_exception(exc)
    if not isinstance(error, BaseException):
        error = UnpicklableEnvError(type_name=type_name, message=message, reason=reason, env_id=env_id)
    error.add_note(f"raised in {where}:\n{text.rstrip()}")
    raise error


CLOSE_REQUEST = bytes(ForkingPickler.dumps(("close", None)))
"""The pickled ``close`` request."""


class StartAbort:
    """Lets another thread give up on an env still starting: :meth:`abort` kills its worker or actor.

    Pass one to ``IsolatedEnv(..., abort=...)`` or ``RayEnv(..., abort=...)``. Aborted before or while the
    env is built, the start raises :class:`EnvClosedError` and leaves no process or actor behind; once the
    env has started, ``abort()`` no longer touches it. A thread cannot be stopped, a process or an actor
    can: this is how a caller that stops waiting for an env (a cancelled rollout) makes sure it never
    arrives.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._aborted = False
        self._starting: Killable | None = None

    def abort(self) -> None:
        """Kills what is still starting, and anything that starts under this later."""
        with self._lock:
            self._aborted = True
            if self._starting is not None:
                self._starting.kill()

    def watch(self, starting: Killable) -> None:
        """Called by the env while it starts: ``abort()`` kills ``starting`` from now on (at once if it was
        aborted already)."""
        with self._lock:
            if self._aborted:
                starting.kill()
            else:
                self._starting = starting

    def forget(self) -> None:
        """Called by the env once its start ended, either way: ``abort()`` no longer touches it."""
        with self._lock:
            self._starting = None


class WorkerEnv(gymnasium.Env[Any, Any], abc.ABC):
    """A local stand-in for an env that lives in a worker that a deadline can end."""

    @property
    @abc.abstractmethod
    def lost(self) -> EnvError | None:
        """The error that ended the worker (a timeout, its death, a close during a call), else None."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether the worker was closed, killed or lost."""

    def kill(self) -> None:
        """Ends the worker at once, whatever it is doing: the env counts as lost, a call in flight raises
        :class:`EnvClosedError`. By default, closes it."""
        self.close()


class RemoteEnv(WorkerEnv):
    """The local surface of an env that lives elsewhere (a worker process, a Ray actor).

    Subclasses start the host (:attr:`_host`) and adopt the env's description (spaces, ``metadata``,
    ``render_mode``, ``spec``); this class turns the Gymnasium API into the host's requests. It is its own
    ``unwrapped``: the real env and its wrappers are out of reach.
    """

    step_timeout: float | None
    reset_timeout: float | None
    _host: Host
    _name: str

    @property
    def lost(self) -> EnvError | None:
        """The error that ended the host (a timeout, its death, a close during a call), else None."""
        return self._host.lost

    @property
    def closed(self) -> bool:
        """Whether the host was closed, killed or lost."""
        return not self._host.running

    def close(self) -> None:
        """Closes the env where it lives and ends its host; later calls do nothing."""
        self._host.close()

    def kill(self) -> None:
        """Kills the env's host now (a worker process, an actor), from any thread."""
        self._host.kill()

    def _request(self, command: str, payload: Any, *, operation: str, timeout: float | None) -> Any:
        """Runs ``command`` on the env and returns its value, or raises what the env raised."""
        return self._host.request(command, payload, operation=operation, timeout=timeout)

    def _adopt(self, description: dict[str, Any]) -> str | None:
        """Copies the env's description here; returns its id (its spec's), if any."""
        self.observation_space = description["observation_space"]
        self.action_space = description["action_space"]
        self.metadata = description["metadata"]
        self.render_mode = description["render_mode"]
        self.spec = description["spec"]
        self._name = description["name"]
        return self.spec.id if self.spec is not None else None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Resets the env, within ``reset_timeout``."""
        result: tuple[Any, dict[str, Any]] = self._request(
            "reset", {"seed": seed, "options": options}, operation="reset", timeout=self.reset_timeout
        )
        return result

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        """Steps the env, within ``step_timeout``."""
        result: tuple[Any, SupportsFloat, bool, bool, dict[str, Any]] = self._request(
            "step", action, operation="step", timeout=self.step_timeout
        )
        return result

    def render(self) -> RenderFrame | list[RenderFrame] | None:
        """Renders the env, within ``step_timeout``."""
        frame: RenderFrame | list[RenderFrame] | None = self._request(
            "render", None, operation="render", timeout=self.step_timeout
        )
        return frame

    def _remote_attr(self, name: str, *, on_unwrapped: bool = False) -> Any:
        return self._request(
            "getattr", (name, on_unwrapped), operation=f"read {name}", timeout=self.step_timeout
        )

    def _set_remote_attr(self, name: str, value: Any, *, on_unwrapped: bool = False) -> None:
        self._request(
            "setattr", (name, value, on_unwrapped), operation=f"set {name}", timeout=self.step_timeout
        )

    @property
    def np_random(self) -> np.random.Generator:
        """The env's random generator, read from where it lives (a copy: setting it sends one there)."""
        generator: np.random.Generator = self._remote_attr("np_random")
        return generator

    @np_random.setter
    def np_random(self, value: np.random.Generator) -> None:
        self._set_remote_attr("np_random", value)

    @property
    def np_random_seed(self) -> int:
        """The seed of the env's random generator, read from where it lives."""
        seed: int = self._remote_attr("np_random_seed")
        return seed

    # check_env reads the private generator of ``unwrapped``, which for a remote env is this object.
    @property
    def _np_random(self) -> np.random.Generator | None:
        generator: np.random.Generator | None = self._remote_attr("_np_random", on_unwrapped=True)
        return generator

    @_np_random.setter
    def _np_random(self, value: np.random.Generator | None) -> None:
        self._set_remote_attr("_np_random", value, on_unwrapped=True)
