"""ResilientEnv: a Gymnasium wrapper that always closes its env and reports failures as typed errors.

Foreign exceptions become typed errors at one boundary: the ``except`` clauses of ``reset`` and ``step``,
which hand an ``Exception`` to ``_failed`` (close, then raise the typed error from it) and anything else
(cancellation, ``KeyboardInterrupt``) to ``_close_while_propagating``. It is a ``try``, not a context
manager as httpx's is, because ``step`` is the hot path (docs/performance.md).

An inner :class:`~gym_resilience.backends.protocol.WorkerEnv` (built by :meth:`ResilientEnv.isolated`)
raises its own typed errors (timed out, died, closed during the call); they pass through unchanged and mark
the env closed whatever ``close_on_error`` says.
"""

from __future__ import annotations

import enum
import reprlib
import threading
import warnings
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal, NoReturn, SupportsFloat, SupportsIndex

import gymnasium
import tenacity
from gymnasium.core import ActType, ObsType, RenderFrame

from gym_resilience.backends.process import IsolatedEnv
from gym_resilience.backends.protocol import DEFAULT_CLOSE_TIMEOUT_S, WorkerEnv
from gym_resilience.errors import (
    EnvClosedError,
    EnvCloseError,
    EnvResetError,
    EnvStepError,
    UnsupportedConfigError,
    describe_exception,
)
from gym_resilience.retry import RetryPolicy

__all__ = ["ResilientEnv"]


class _State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


_OPEN = _State.OPEN
_CLOSED = _State.CLOSED

_action_repr = reprlib.Repr()
_action_repr.maxstring = 60
_action_repr.maxother = 60
_action_repr.maxlist = _action_repr.maxtuple = _action_repr.maxdict = 6


# reprlib also survives an action whose __repr__ raises: the step failure must not be hidden by it.
_short_repr = _action_repr.repr

_NEEDS_ISOLATION = (
    "needs ResilientEnv.isolated: a deadline is kept by killing the process that runs the env, and a thread "
    "cannot be stopped"
)


class _Closer:
    """The close-once state, shared by a ResilientEnv and its finalizer.

    The finalizer must not reference the wrapper (it would keep it alive forever), so the state that both
    need lives here: the inner env and whether it was closed.
    """

    __slots__ = ("_lock", "env", "state")

    def __init__(self, env: gymnasium.Env[Any, Any]) -> None:
        self.env = env
        self.state = _OPEN
        # Runners call env methods from executor threads: two close requests must not both get through.
        self._lock = threading.Lock()

    def close(self) -> None:
        """Closes the inner env unless that was already requested; raises what its close() raised."""
        with self._lock:
            if self.state is _CLOSED:
                return
            # Mark first: a close() that raises, or re-enters, still counts as the one close.
            self.state = _CLOSED
        self.env.close()


def _close_at_collection(closer: _Closer) -> None:
    """Finalizer: closes an env whose wrapper was collected, or left open at interpreter exit."""
    if closer.state is _CLOSED:
        return
    try:
        closer.close()
    except Exception as exc:  # nobody is left to raise to
        failure = f"; its close() raised {describe_exception(exc)}"
    else:
        failure = ""
    warnings.warn(
        f"unclosed ResilientEnv around {closer.env!r} was closed by the garbage collector{failure}",
        ResourceWarning,
        stacklevel=1,  # no caller to point at: the collector called this
        source=closer.env,  # with tracemalloc on, Python shows where the env was allocated
    )


class ResilientEnv(
    gymnasium.Wrapper[ObsType, ActType, ObsType, ActType], gymnasium.utils.RecordConstructorArgs
):
    """Closes its env exactly once on every exit path, and reports its failures as typed errors.

    The inner ``close()`` runs once however the wrapper ends: ``close()``, a failing ``reset``/``step``
    (unless ``close_on_error=False``), an interruption (it propagates unchanged), a ``with`` block,
    garbage collection or interpreter exit. Failures arrive as :class:`EnvResetError`,
    :class:`EnvStepError`, :class:`EnvCloseError` or :class:`EnvClosedError`, the original as
    ``__cause__``; a close failure never masks the exception in flight (it becomes a note and
    :attr:`close_error`). ``step`` is never retried (not idempotent); ``reset`` is, under ``reset_retry``.
    Spaces, ``metadata``, ``render``, ``unwrapped`` and ``spec`` pass through, so Gymnasium's
    ``check_env`` accepts the wrapped env.

    Deadlines need :meth:`isolated`, which runs the env in a worker process that a deadline kills
    (:class:`EnvTimeoutError`, :class:`EnvWorkerDiedError`); ``self.env`` is then the local
    :class:`~gym_resilience.backends.process.IsolatedEnv` stand-in.

    Args:
        env: The env to wrap; the wrapper owns it from now on.
        close_on_error: Close the inner env when ``reset``/``step`` raises an ``Exception`` (default).
            With False the env stays open after such an error; interruptions still close it.
        reset_retry: Retry ``reset`` on ``reset_retry.retry_on`` errors; None (default) tries once.
            A worker that timed out or died is never retried.
        isolate, step_timeout, reset_timeout, start_timeout, close_timeout: The deprecated spelling of
            :meth:`isolated` (``isolate=True`` warns); deadlines without it are refused.

    Raises:
        UnsupportedConfigError: a deadline without isolation, or an option of the wrong type. A refused
            ``env`` is closed all the same: it was handed over.
        TypeError: ``env`` is not a ``gymnasium.Env``.

    A ResilientEnv cannot be copied or pickled (``TypeError``): it owns its env's one close.

    Attributes:
        close_error: The :class:`EnvCloseError` (cause: what the inner ``close()`` raised) when closing
            failed, else None.

    Example:
        >>> from gym_resilience.testing import ScriptableEnv
        >>> def step(env, action):
        ...     raise ConnectionError("tool server went away")
        >>> inner = ScriptableEnv(step=step)
        >>> with ResilientEnv(inner) as env:
        ...     _ = env.reset(seed=0)
        ...     try:
        ...         env.step("ls")
        ...     except EnvStepError as error:
        ...         print(error)
        env step failed at turn 0 (action='ls'): ConnectionError: tool server went away
        >>> inner.close_calls
        1
    """

    def __init__(
        self,
        env: gymnasium.Env[ObsType, ActType] | Callable[[], gymnasium.Env[ObsType, ActType]],
        *,
        close_on_error: bool = True,
        reset_retry: RetryPolicy | None = None,
        isolate: bool = False,
        step_timeout: float | None = None,
        reset_timeout: float | None = None,
        start_timeout: float | None = None,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT_S,
    ) -> None:
        # The spec records no isolation: a spec re-creates the env in-process, it cannot carry a factory.
        # Both values are immutable (a bool, a frozen RetryPolicy): no deep copy, which cost 10 of the 15 us
        # it took to wrap an env (a batch wraps one per rollout).
        gymnasium.utils.RecordConstructorArgs.__init__(
            self, _disable_deepcopy=True, close_on_error=close_on_error, reset_retry=reset_retry
        )
        try:
            _check_options(close_on_error, reset_retry)
            if isolate:
                warnings.warn(
                    "ResilientEnv(factory, isolate=True, ...) is deprecated: use "
                    "ResilientEnv.isolated(factory, ...)",
                    DeprecationWarning,
                    stacklevel=2,
                )
                env = _isolated_env(env, step_timeout, reset_timeout, start_timeout, close_timeout)
            else:
                _check_no_deadline(step_timeout, reset_timeout, start_timeout, close_timeout)
                if not isinstance(env, gymnasium.Env):
                    raise TypeError(
                        "expected a gymnasium.Env (or, with ResilientEnv.isolated, a factory of one), "
                        f"got {env!r}"
                    )
        except BaseException as rejected:
            # The env was handed over: a wrapper that is never made still closes it.
            _close_rejected(env, rejected)
            raise
        # One the caller built counts as isolated too, under any wrappers: a worker it lost is closed,
        # never retried.
        inner = env.unwrapped
        self._isolated: WorkerEnv | None = inner if isinstance(inner, WorkerEnv) else None
        gymnasium.Wrapper.__init__(self, env)
        self.close_on_error = close_on_error
        self.reset_retry = reset_retry
        self.close_error: EnvCloseError | None = None
        self._turn = 0
        spec = env.unwrapped.spec
        self._env_id = spec.id if spec is not None else None
        self._closer = _Closer(env)
        self._finalizer = weakref.finalize(self, _close_at_collection, self._closer)

    @classmethod
    def isolated(
        cls,
        env_fn: Callable[[], gymnasium.Env[ObsType, ActType]],
        *,
        step_timeout: float | None = None,
        reset_timeout: float | None = None,
        start_timeout: float | None = None,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT_S,
        close_on_error: bool = True,
        reset_retry: RetryPolicy | None = None,
    ) -> ResilientEnv[ObsType, ActType]:
        """A ResilientEnv around the env that ``env_fn`` builds in a worker process that deadlines can kill.

        Args:
            env_fn: A picklable zero-argument callable that builds the env in the worker process.
            step_timeout: Deadline of each ``step`` (and ``render``), in seconds; None: no limit.
            reset_timeout: Deadline of each ``reset`` attempt; None: no limit.
            start_timeout: Deadline for the worker to start and build the env; None: no limit. For the
                first isolated env of a program it includes the fork server's start.
            close_timeout: How long ``close`` waits for the env to close before killing its worker.
            close_on_error: As for the constructor.
            reset_retry: As for the constructor.

        Raises:
            UnsupportedConfigError: a timeout that is not a number > 0, an env instance or an
                unpicklable factory, or an option of the wrong type.
        """
        _check_options(close_on_error, reset_retry)  # before a worker starts
        isolated = _isolated_env(env_fn, step_timeout, reset_timeout, start_timeout, close_timeout)
        return cls(isolated, close_on_error=close_on_error, reset_retry=reset_retry)

    @property
    def closed(self) -> bool:
        """Whether the inner env was closed (or its close was attempted)."""
        return self._closer.state is _CLOSED

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[ObsType, dict[str, Any]]:
        """Resets the inner env, retrying transient errors when a ``reset_retry`` policy is set.

        Raises:
            EnvResetError: the reset failed (after ``attempts`` attempts); ``__cause__`` is the last error.
            EnvClosedError: the env was closed.
        """
        if self._closer.state is _CLOSED:
            raise EnvClosedError(operation="reset", env_id=self._env_id)
        self._turn = 0
        attempts = 0

        def reset_once() -> tuple[ObsType, dict[str, Any]]:
            nonlocal attempts
            attempts += 1
            return self.env.reset(seed=seed, options=options)

        try:
            if self.reset_retry is None:
                result = reset_once()
            else:
                result = self._reset_retrying(self.reset_retry)(reset_once)
        except Exception as exc:
            if self._isolated is not None and self._isolated.lost is not None:
                self._close_while_propagating(exc)
                raise
            raise self._failed(EnvResetError(attempts=attempts, env_id=self._env_id)) from exc
        except BaseException as exc:
            self._close_while_propagating(exc)
            raise
        return result

    def step(self, action: ActType) -> tuple[ObsType, SupportsFloat, bool, bool, dict[str, Any]]:
        """Steps the inner env once; never retried.

        Raises:
            EnvStepError: the step failed; ``__cause__`` is the original error.
            EnvClosedError: the env was closed.
        """
        if self._closer.state is _CLOSED:
            raise EnvClosedError(operation="step", env_id=self._env_id)
        # Every step counts, failed ones too: with close_on_error=False the next one is a turn later.
        turn = self._turn
        self._turn = turn + 1
        try:
            return self.env.step(action)
        except Exception as exc:
            if self._isolated is not None and self._isolated.lost is not None:
                self._close_while_propagating(exc)
                raise
            error = EnvStepError(turn=turn, action_repr=_short_repr(action), env_id=self._env_id)
            raise self._failed(error) from exc
        except BaseException as exc:
            self._close_while_propagating(exc)
            raise

    def render(self) -> RenderFrame | list[RenderFrame] | None:
        """Renders the inner env. What its ``render`` raises passes through unchanged (a frame is not
        part of a rollout), and leaves the env open unless the worker of an isolated env was lost; an
        interruption (``KeyboardInterrupt``, a cancellation) closes it, as in ``step``.

        Raises:
            EnvClosedError: the env was closed.
        """
        if self._closer.state is _CLOSED:
            raise EnvClosedError(operation="render", env_id=self._env_id)
        try:
            return self.env.render()
        except Exception as exc:
            if self._isolated is not None and self._isolated.lost is not None:
                self._close_while_propagating(exc)
            raise
        except BaseException as exc:
            self._close_while_propagating(exc)
            raise

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        """Refuses ``copy``, ``deepcopy`` and ``pickle``: a copy would share the one close of the env, or
        own a second env that nothing closes."""
        raise TypeError(
            "a ResilientEnv cannot be copied or pickled: it closes its env exactly once. Wrap a new env "
            "instead (gymnasium.make(env.spec) builds one), or pass a factory (ResilientEnv.isolated)"
        )

    def close(self) -> None:
        """Closes the inner env, once; later calls do nothing.

        Raises:
            EnvCloseError: the inner ``close()`` raised (the env still counts as closed); ``__cause__``
                is the original error, and the error is also kept in :attr:`close_error`.
        """
        try:
            self._close_inner()
        except Exception as exc:
            raise self._record_close_failure(exc) from exc

    def __exit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> Literal[False]:
        """Closes the env on leaving a ``with`` block; an exception leaving the block is never masked."""
        if exc is None:
            self.close()
        else:
            self._close_while_propagating(exc)
        return False

    def _reset_retrying(self, policy: RetryPolicy) -> tenacity.Retrying:
        retrying = policy.retrying()
        isolated = self._isolated
        if isolated is None:
            return retrying
        # A worker that timed out or died is gone: another attempt would only find the env closed.
        still_there = tenacity.retry_if_exception(lambda _: isolated.lost is None)
        return retrying.copy(retry=retrying.retry & still_there)

    def _close_inner(self) -> None:
        self._finalizer.detach()
        self._closer.close()

    def _failed(self, error: Exception) -> Exception:
        """The boundary where an inner failure becomes ``error``: closes the env unless opted out."""
        if self.close_on_error:
            self._close_while_propagating(error)
        return error

    def _close_while_propagating(self, propagating: BaseException) -> None:
        """Closes the env while ``propagating`` is on its way out, never masking it by a close failure."""
        try:
            self._close_inner()
        except Exception as exc:
            # Its message ends with what close() raised, rendered even if that cannot print itself.
            propagating.add_note(str(self._record_close_failure(exc)))

    def _record_close_failure(self, cause: Exception) -> EnvCloseError:
        error = EnvCloseError(env_id=self._env_id)
        error.__cause__ = cause
        self.close_error = error
        return error


def _check_options(close_on_error: object, reset_retry: object) -> None:
    if not isinstance(close_on_error, bool):
        raise UnsupportedConfigError(
            f"close_on_error must be True or False, got {close_on_error!r}", option="close_on_error"
        )
    if reset_retry is not None and not isinstance(reset_retry, RetryPolicy):
        raise UnsupportedConfigError(
            f"reset_retry must be a RetryPolicy or None, got {reset_retry!r}", option="reset_retry"
        )


def _close_rejected(env: object, rejected: BaseException) -> None:
    """Closes an env handed to a wrapper that refused it; a close failure is noted on ``rejected``."""
    if not isinstance(env, gymnasium.Env):
        return
    try:
        env.close()
    except Exception as exc:
        rejected.add_note(f"closing the env also failed: {describe_exception(exc)}")


def _check_no_deadline(
    step_timeout: float | None, reset_timeout: float | None, start_timeout: float | None, close_timeout: float
) -> None:
    """Refuses deadlines for an env that runs in a thread: they could not be kept."""
    for option, value in (
        ("step_timeout", step_timeout),
        ("reset_timeout", reset_timeout),
        ("start_timeout", start_timeout),
    ):
        if value is not None:
            raise UnsupportedConfigError(_NEEDS_ISOLATION, option=option)
    if close_timeout != DEFAULT_CLOSE_TIMEOUT_S:
        raise UnsupportedConfigError(_NEEDS_ISOLATION, option="close_timeout")


def _isolated_env(
    env_fn: object,
    step_timeout: float | None,
    reset_timeout: float | None,
    start_timeout: float | None,
    close_timeout: float,
) -> IsolatedEnv:
    """The worker-process stand-in for the env that ``env_fn`` builds there."""
    if isinstance(env_fn, gymnasium.Env) or not callable(env_fn):
        raise UnsupportedConfigError(
            "an isolated env is built in a worker process: pass a picklable zero-argument "
            f"callable that builds it, not {env_fn!r}",
            option="env",
        )
    return IsolatedEnv(
        env_fn,
        step_timeout=step_timeout,
        reset_timeout=reset_timeout,
        start_timeout=start_timeout,
        close_timeout=close_timeout,
    )
