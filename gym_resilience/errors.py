"""Every exception gym_resilience raises, in one place.

The tree::

    GymResilienceError
    ├── EnvError                        an environment failed or was misused
    │   ├── EnvResetError               reset() raised
    │   ├── EnvStepError                step() raised (turn index, short action repr)
    │   ├── EnvCloseError               close() raised
    │   ├── EnvClosedError              used after close: "you closed it", not "it broke"
    │   ├── EnvTimeoutError             (also TimeoutError) a call on an isolated env ran past its deadline
    │   ├── EnvWorkerDiedError          an isolated env's worker process or Ray actor died
    │   └── UnpicklableEnvError         stands in for an isolated env's exception that did not pickle
    ├── EngineError                     an engine failed to serve a request
    │   ├── EngineClosedError           (also RuntimeError) used before start or after close
    │   ├── EngineDeadError             the engine (or every endpoint) died
    │   ├── EngineRequestError          (also ValueError) the engine rejected the request as invalid
    │   └── EngineContractError         check_engine found the engine breaking the runner's contract
    ├── DependencyNotInstalledError     (also ImportError) an optional dependency is missing
    ├── BrokenDependencyError           (also ImportError) an installed dependency fails to import
    ├── RolloutError                    one rollout failed (index, phase, turn, elapsed)
    │   └── RolloutTimeoutError         (also TimeoutError) one rollout ran past its deadline
    ├── AllRolloutsFailedError          (also RuntimeError) every rollout of a batch failed
    ├── FailureBudgetExceededError      more rollouts failed than max_failed_fraction allows
    ├── UnsupportedConfigError          (also ValueError) a configuration that cannot work
    └── OutputValidationError           (also ValueError) a BatchOutput breaks the trainer's contract

The chaos harness's ``ScenarioError`` (a scenario file is invalid) derives from ``GymResilienceError`` in
``harness.errors``.

Context travels as keyword-only attributes and every error pickles with it, because errors cross
process boundaries (isolated environments, served engines, the harness's journal).

Every message ends with the root cause, so a failure reads as what actually went wrong::

    env step failed at turn 1 (action='ls') [WordGame-v0]: ConnectionError: sandbox connection dropped

The root cause is the innermost exception of the ``__cause__`` chain that is not one of these errors
(:func:`root_cause`); it is rendered by :func:`describe_exception`, which never raises and bounds a
foreign message to ``MAX_MESSAGE_CHARS`` characters. Every place that renders an exception uses it: a
failure must never be lost because its exception cannot be printed. A value in a message is named by
:func:`show`, as YAML or JSON data writes it.
"""

from __future__ import annotations

import math
import pickle
import signal
from collections.abc import Sequence
from typing import Any, Final, Literal

from gym_resilience._moved import forward

Phase = Literal["reset", "generate", "step", "close"]

__all__ = [
    "MAX_MESSAGE_CHARS",
    "AllRolloutsFailedError",
    "BrokenDependencyError",
    "DependencyNotInstalledError",
    "EngineClosedError",
    "EngineContractError",
    "EngineDeadError",
    "EngineError",
    "EngineRequestError",
    "EnvCloseError",
    "EnvClosedError",
    "EnvError",
    "EnvResetError",
    "EnvStepError",
    "EnvTimeoutError",
    "EnvWorkerDiedError",
    "FailureBudgetExceededError",
    "GymResilienceError",
    "OutputValidationError",
    "Phase",
    "RolloutError",
    "RolloutTimeoutError",
    "UnpicklableEnvError",
    "UnsupportedConfigError",
    "describe_exception",
    "exception_message",
    "root_cause",
    "show",
]

MAX_MESSAGE_CHARS: Final = 500
"""How much of a foreign exception's message a rendering keeps; the rest is cut and counted."""


def exception_message(exc: BaseException) -> str:
    """``str(exc)``, but never raising: a broken ``__str__`` gives ``<unprintable T object>``.

    A foreign message longer than ``MAX_MESSAGE_CHARS`` is cut there, with a count of what was cut;
    the messages of gym_resilience's own errors are built from bounded parts and kept whole.
    """
    try:
        text = str(exc)
    except Exception:  # __str__ raised, or returned a non-str (str() raises TypeError then)
        return f"<unprintable {type(exc).__name__} object>"
    if len(text) <= MAX_MESSAGE_CHARS or isinstance(exc, GymResilienceError):
        return text
    return f"{text[:MAX_MESSAGE_CHARS]}... [{len(text) - MAX_MESSAGE_CHARS} more characters]"


def describe_exception(exc: BaseException) -> str:
    """``"Type: message"`` (``"Type"`` for an empty message), never raising; see ``exception_message``."""
    text = exception_message(exc)
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


def show(value: Any) -> str:
    """A value as YAML or JSON data writes it: ``'three'``, ``3``, ``true``, ``null``, ``a list``.

    Anything data cannot hold is named by its type (``a tuple``, ``a function``); a long string is cut.
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else ".inf" if value > 0 else "-.inf"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:57] + "...")
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


def root_cause(exc: BaseException) -> BaseException:
    """What actually went wrong: the innermost exception of the ``__cause__`` chain (``exc`` included)
    that is not a :class:`GymResilienceError`.

    When every link is one of ours, the innermost link (``exc`` itself when it has no cause).
    """
    chain = [exc]
    seen = {id(exc)}
    cause = exc.__cause__
    while cause is not None and id(cause) not in seen:  # a cycle is possible: __cause__ is writable
        chain.append(cause)
        seen.add(id(cause))
        cause = cause.__cause__
    foreign = [link for link in chain if not isinstance(link, GymResilienceError)]
    return foreign[-1] if foreign else chain[-1]


def _rebuild(
    cls: type[BaseException],
    args: tuple[Any, ...],
    state: dict[str, Any],
    cause_text: str = "",
    cause: BaseException | None = None,
) -> BaseException:
    error = cls.__new__(cls, *args)
    error.args = args
    if isinstance(error, ImportError) and args:
        error.msg = args[0]  # ImportError keeps it apart from args, and only its __init__ sets it
    error.__dict__.update(state)
    if cause_text:
        # The rendering of the cause is kept, so the message stays the same even if the cause did not
        # travel.
        error.__dict__["_pickled_cause_text"] = cause_text
    error.__cause__ = cause
    return error


def _portable_cause(error: BaseException) -> BaseException | None:
    """``error.__cause__`` when it survives a pickle round trip (so what retries read, such as a
    ``ConnectionError`` under an ``EnvStepError``, crosses a process boundary), else None."""
    cause = error.__cause__
    if cause is None or _cause_cycles(error):
        return None
    try:
        pickle.loads(pickle.dumps(cause))
    except Exception:
        return None
    return cause


def _cause_cycles(error: BaseException) -> bool:
    seen = {id(error)}
    cause = error.__cause__
    while cause is not None:
        if id(cause) in seen:
            return True
        seen.add(id(cause))
        cause = cause.__cause__
    return False


class GymResilienceError(Exception):
    """Raised for any failure gym_resilience reports; catch it to handle them all.

    Subclasses build their message from keyword-only context in ``__init__``; ``str()`` adds the root
    cause (``": ConnectionError: sandbox connection dropped"``) when there is one. It is computed when
    rendered because ``raise ... from exc`` sets ``__cause__`` after ``__init__``. Pickling restores
    the message and the context without calling ``__init__`` again, and ``__cause__`` when it pickles
    too (an unpicklable cause is dropped; the message still names it).
    """

    def __str__(self) -> str:
        text = super().__str__()
        cause_text = self._cause_text()
        suffix = f": {cause_text}"
        # A message that already ends with its cause (one that quotes it) does not say it twice.
        return text if not cause_text or text.endswith(suffix) else f"{text}{suffix}"

    def _cause_text(self) -> str:
        root = root_cause(self)
        # The root's rendering from before a pickle round trip its own cause did not survive.
        pickled = root.__dict__.get("_pickled_cause_text", "") if isinstance(root, GymResilienceError) else ""
        if root is self or pickled:
            return str(pickled)
        if isinstance(root, GymResilienceError):
            # Its own message only: through a __cause__ cycle its str() would come back here.
            text = Exception.__str__(root)
            return f"{type(root).__name__}: {text}" if text else type(root).__name__
        return describe_exception(root)

    def __reduce__(self) -> tuple[Any, ...]:
        state = dict(self.__dict__)
        return (_rebuild, (type(self), self.args, state, self._cause_text(), _portable_cause(self)))


class EnvError(GymResilienceError):
    """Raised when an environment fails or is misused; ``env_id`` names it when it has a spec.

    The original exception, if any, is ``__cause__``.
    """

    def __init__(self, message: str, *, env_id: str | None = None) -> None:
        self.env_id = env_id
        where = f" [{env_id}]" if env_id else ""
        super().__init__(f"{message}{where}")


class EnvResetError(EnvError):
    """Raised when ``reset()`` raised (after any retries); the env is closed unless opted out.

    Check ``__cause__`` for the original failure; ``attempts`` says how many resets were tried.
    """

    def __init__(self, *, attempts: int = 1, env_id: str | None = None) -> None:
        self.attempts = attempts
        tries = "" if attempts == 1 else f" after {attempts} attempts"
        super().__init__(f"env reset failed{tries}", env_id=env_id)


class EnvStepError(EnvError):
    """Raised when ``step()`` raised; the env is closed unless opted out.

    ``turn`` is the 0-based index of the failing step since the last reset, ``action_repr`` a short
    repr of the action. Steps are not retried: they are not idempotent.
    """

    def __init__(self, *, turn: int, action_repr: str, env_id: str | None = None) -> None:
        self.turn = turn
        self.action_repr = action_repr
        super().__init__(f"env step failed at turn {turn} (action={action_repr})", env_id=env_id)


class EnvCloseError(EnvError):
    """Raised when the inner ``close()`` raised; the env still counts as closed.

    While another exception propagates, a close failure is attached to it as a note instead.
    """

    def __init__(self, *, env_id: str | None = None) -> None:
        super().__init__("env close failed", env_id=env_id)


class EnvClosedError(EnvError):
    """Raised when an env is used after it was closed, or cannot start because what it would run on was
    closed (a runner's env workers): the caller's doing, not an env failure.

    Create a new env (or runner) instead; ``operation`` names the call that was refused, ``why`` what was
    closed.
    """

    def __init__(self, *, operation: str, env_id: str | None = None, why: str = "the env is closed") -> None:
        self.operation = operation
        self.why = why
        super().__init__(f"cannot {operation}: {why}", env_id=env_id)


class EnvTimeoutError(EnvError, TimeoutError):
    """Raised when a call on an isolated env ran past its deadline; its worker was killed, the env is closed.

    ``operation`` names the call (``step``, ``reset``, ``render``, ``start``, ``close``). Raise the deadline
    or fix the env; the rollout cannot continue with this env.
    """

    def __init__(self, *, operation: str, timeout_s: float, env_id: str | None = None) -> None:
        self.operation = operation
        self.timeout_s = timeout_s
        super().__init__(f"env {operation} exceeded its {timeout_s:g} s deadline", env_id=env_id)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit code unknown"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class EnvWorkerDiedError(EnvError):
    """Raised when the worker of an env (its process, or its Ray actor) died during a call; the env counts
    as closed.

    A worker process crashed, exited, or was killed from outside (``exitcode`` -9, SIGKILL, is often the
    kernel's OOM killer); a Ray actor was killed, or the node it ran on died (``node_id`` names that
    node, when known). ``operation`` names the call, ``exitcode`` is the process's exit code (negative:
    the signal that killed it; None: unknown, or an actor). Create a new env; the worker's stderr (an
    actor's: the node's Ray logs) may say why it died. ``__cause__`` is Ray's own error for an actor.
    """

    def __init__(
        self,
        *,
        operation: str,
        exitcode: int | None = None,
        env_id: str | None = None,
        actor_id: str | None = None,
        node_id: str | None = None,
    ) -> None:
        self.operation = operation
        self.exitcode = exitcode
        self.actor_id = actor_id
        self.node_id = node_id
        if actor_id is None:
            what = f"env worker process died during {operation} ({_describe_exit(exitcode)})"
        else:
            where = f"node {node_id}" if node_id else "an unknown node"
            what = f"env actor {actor_id} on {where} died during {operation}"
        super().__init__(what, env_id=env_id)


class UnpicklableEnvError(EnvError):
    """Raised in place of an exception from an isolated env that could not be pickled back to the parent.

    ``type_name`` is the original exception's qualified type, ``message`` its text, ``reason`` why it did not
    pickle; its traceback from the worker is a note. To receive the exception as itself, make it picklable
    (an exception whose ``__init__`` takes other arguments than ``args`` needs a ``__reduce__``).
    """

    def __init__(self, *, type_name: str, message: str, reason: str, env_id: str | None = None) -> None:
        self.type_name = type_name
        self.message = message
        self.reason = reason
        super().__init__(f"{type_name}: {message} (it could not be pickled: {reason})", env_id=env_id)


class EngineError(GymResilienceError):
    """Raised when an engine fails to serve a request; the engine's own exception is ``__cause__``.

    An ``EngineError`` alone is not retried: a ``RetryPolicy`` (``RunnerConfig.retry``) reruns the
    rollout only when the error or its ``__cause__`` chain matches ``retry_on`` (by default
    ``TRANSIENT_ERRORS``: a connection error or a timeout). If the engine itself died, see
    ``EngineDeadError``.
    """


class EngineClosedError(EngineError, RuntimeError):
    """Raised when an engine is used before ``start()`` or after ``aclose()``: "you closed it".

    Start the engine (``async with VLLMEngine(...) as engine:``) or create a new one.
    """


class EngineDeadError(EngineError):
    """Raised when the engine died ("it broke"), or every endpoint of a served engine is down.

    An engine of this process that died: close it and start a new one; retrying on it cannot succeed.
    A served engine's endpoints come back once their health check passes: its error's cause is the
    last endpoint's transient failure, which ``RetryPolicy`` retries.
    """


class EngineRequestError(EngineError, ValueError):
    """Raised when the engine rejects a request as invalid (e.g. a prompt longer than ``max_model_len``).

    Fix the request; retrying it unchanged fails again.
    """


class EngineContractError(EngineError):
    """Raised when ``check_engine`` found an engine breaking the contract the runner relies on.

    ``problems`` lists every problem found (each names the part of the contract it breaks), not just the
    first; ``engine`` is the engine's type name. Fix the engine; the runner would fail its rollouts, or
    keep data no trainer can use.
    """

    def __init__(self, problems: Sequence[str], *, engine: str) -> None:
        self.problems = tuple(problems)
        self.engine = engine
        listed = "\n".join(f"  - {problem}" for problem in self.problems)
        count = f"{len(self.problems)} problem{'' if len(self.problems) == 1 else 's'}"
        super().__init__(f"{engine} breaks the engine contract ({count}):\n{listed}")


class DependencyNotInstalledError(GymResilienceError, ImportError):
    """Raised when an optional dependency a backend needs is not installed.

    Install the extra the message names (``package`` and ``extra`` say which); nothing was started.
    """

    def __init__(self, *, package: str, extra: str) -> None:
        self.package = package
        self.extra = extra
        super().__init__(f"{package} is not installed; install it with: pip install {extra}")


class BrokenDependencyError(GymResilienceError, ImportError):
    """Raised when an installed package fails to import, so the backend that imports it cannot start.

    ``packages`` names them, ``reason`` says why, and ``fix`` is the command that repairs the
    environment; ``__cause__`` is the first package's import error. Nothing was started.
    """

    def __init__(self, *, packages: Sequence[str], reason: str, fix: str) -> None:
        self.packages = tuple(packages)
        self.reason = reason
        self.fix = fix
        super().__init__(f"{', '.join(self.packages)} failed to import ({reason}); fix with `{fix}`")


class RolloutError(GymResilienceError):
    """Raised when one rollout of a batch failed; ``__cause__`` is what failed inside it.

    ``phase`` is where (reset, generate, step, close), ``turn`` the agent turn (None before the first),
    ``elapsed_s`` the rollout's measured time until the failure.
    """

    def __init__(
        self, *, rollout_index: int, phase: Phase, turn: int | None, elapsed_s: float, detail: str = ""
    ) -> None:
        self.rollout_index = rollout_index
        self.phase = phase
        self.turn = turn
        self.elapsed_s = elapsed_s
        at_turn = "" if turn is None else f" at turn {turn}"
        tail = f": {detail}" if detail else ""
        super().__init__(f"rollout {rollout_index} failed in {phase}{at_turn} after {elapsed_s:.3f} s{tail}")


class RolloutTimeoutError(RolloutError, TimeoutError):
    """Raised when a rollout, or one generation of it (``what``), ran past its deadline.

    Its generation was aborted in the engine and its env closed; a ``RetryPolicy`` retrying
    ``TimeoutError`` reruns it.
    """

    def __init__(
        self,
        *,
        rollout_index: int,
        phase: Phase,
        turn: int | None,
        elapsed_s: float,
        timeout_s: float,
        what: str = "rollout",
    ) -> None:
        self.timeout_s = timeout_s
        self.what = what
        super().__init__(
            rollout_index=rollout_index,
            phase=phase,
            turn=turn,
            elapsed_s=elapsed_s,
            detail=f"the {what} exceeded its {timeout_s:g} s deadline",
        )


class AllRolloutsFailedError(GymResilienceError, RuntimeError):
    """Raised when every rollout of a batch failed, even with ``skip_failed_rollouts``.

    A step of only placeholders carries no training signal, and a systemic failure (engine down)
    should surface. ``__cause__`` is the first failure; ``exceptions`` holds all of them.
    """

    def __init__(self, exceptions: Sequence[BaseException]) -> None:
        self.exceptions = tuple(exceptions)
        first = self.exceptions[0] if self.exceptions else None
        first_text = f"; first: {describe_exception(first)}" if first is not None else ""
        super().__init__(f"all {len(self.exceptions)} rollouts failed{first_text}")


class FailureBudgetExceededError(GymResilienceError):
    """Raised when more rollouts failed than ``max_failed_fraction`` allows.

    ``exceptions`` holds every failure; ``failed`` and ``total`` the counts. Fix the systemic cause,
    or raise the budget if such failure rates are expected.
    """

    def __init__(
        self, exceptions: Sequence[BaseException], *, total: int, max_failed_fraction: float
    ) -> None:
        self.exceptions = tuple(exceptions)
        self.failed = len(self.exceptions)
        self.total = total
        self.max_failed_fraction = max_failed_fraction
        super().__init__(
            f"{self.failed} of {total} rollouts failed, over the budget of {max_failed_fraction:.0%}"
        )


class UnsupportedConfigError(GymResilienceError, ValueError):
    """Raised when a configuration cannot work as asked; ``option`` names the offending setting.

    ``reason`` is the message without the option's name; ``path`` is where the setting sits in nested
    configuration data (``("runner", "retry", "attempts")``), ``(option,)`` unless given. Change the
    configuration as the message says; nothing was run.
    """

    def __init__(self, message: str, *, option: str, path: Sequence[str | int] | None = None) -> None:
        self.option = option
        self.reason = message
        self.path: tuple[str | int, ...] = (option,) if path is None else tuple(path)
        super().__init__(f"{option}: {message}")


class OutputValidationError(GymResilienceError, ValueError):
    """Raised when a ``BatchOutput`` breaks the contract a trainer relies on.

    ``problems`` lists every problem found (each names the sample index and column), not just the first.
    """

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        listed = "\n".join(f"  - {problem}" for problem in self.problems)
        super().__init__(f"batch output is invalid ({len(self.problems)} problems):\n{listed}")


# Moved: the transience rules to retry, the future adapter to cleanup, ScenarioError to the harness.
__getattr__ = forward(__name__, "gym_resilience.retry", "gym_resilience.cleanup", "harness.errors")
