"""RetryPolicy: how often, how long and on what to retry an idempotent operation.

A policy is a frozen value; it decides nothing by itself. :meth:`RetryPolicy.retrying` and
:meth:`RetryPolicy.async_retrying` turn it into tenacity controllers, so the same policy drives a sync
``reset`` retry in :class:`~gym_resilience.ResilientEnv` and an async whole-rollout retry in a runner.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import tenacity

from gym_resilience.backends.deadlines import check_seconds
from gym_resilience.errors import UnsupportedConfigError

__all__ = ["DEFAULT_RETRY_ON", "TRANSIENT_ERRORS", "RetryPolicy", "is_transient", "is_transient_status"]

TRANSIENT_ERRORS: Final[tuple[type[Exception], ...]] = (ConnectionError, TimeoutError)
"""What is transient: a dropped or refused connection and a timed-out call (another attempt may succeed).

``ConnectionError`` covers ``BrokenPipeError``, ``ConnectionResetError``, ``ConnectionRefusedError`` and
``ConnectionAbortedError``; ``TimeoutError`` covers ``socket.timeout``, ``asyncio.TimeoutError`` and this
library's ``EnvTimeoutError`` and ``RolloutTimeoutError``. ``RetryPolicy`` retries these by default.
"""


def is_transient(error: BaseException, kinds: tuple[type[BaseException], ...] = TRANSIENT_ERRORS) -> bool:
    """Whether ``error`` or an error in its ``__cause__`` chain is one of ``kinds``.

    The chain counts: an env's ``ConnectionError`` arrives wrapped in an ``EnvStepError``, and it is
    still a connection error.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, kinds):
            return True
        seen.add(id(current))
        current = current.__cause__
    return False


def is_transient_status(status: int) -> bool:
    """Whether an HTTP error status blames the server's state rather than the request.

    5xx, 408 (timeout) and 429 (overloaded) are transient: another endpoint, or a later attempt, may
    serve the same request. Any other 4xx blames the request. Statuses below 400 are not errors.
    """
    return status >= 500 or status in (408, 429)


DEFAULT_RETRY_ON: tuple[type[Exception], ...] = TRANSIENT_ERRORS
"""Errors worth retrying by default: the transient ones (:data:`TRANSIENT_ERRORS`)."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Bounded retries with jittered exponential backoff.

    Attempt ``n`` (1-based) that failed with a retryable error is followed by a sleep of
    ``min(initial_delay_s * 2 ** (n - 1) + uniform(0, jitter_s), max_delay_s)``, then attempt ``n + 1``,
    until ``attempts`` attempts were made or the next attempt would start more than ``total_delay_s``
    after the first one. The last error is then re-raised as it was.

    Args:
        attempts: Attempts in all, the first included (1 means no retry).
        initial_delay_s: Sleep before the first retry, before jitter.
        max_delay_s: Cap on any one sleep.
        jitter_s: Upper bound of the uniform random delay added to each sleep, so that many failing
            callers do not retry in lockstep.
        total_delay_s: Time budget from the first attempt; no attempt starts after it. None: no budget.
        retry_on: Error types worth retrying; any other error is re-raised at once. Only ``Exception``
            subclasses: cancellation and ``KeyboardInterrupt`` always propagate.
        sleep: How a sync retry sleeps (inject a fake in tests).
        async_sleep: How an async retry sleeps (inject a fake in tests).

    Raises:
        UnsupportedConfigError: (a ``ValueError``) an argument is out of range.

    Example:
        >>> policy = RetryPolicy(attempts=3, sleep=lambda _s: None)
        >>> calls = []
        >>> def flaky_connect():
        ...     calls.append(1)
        ...     if len(calls) < 3:
        ...         raise ConnectionError("refused")
        ...     return "connected"
        >>> policy.retrying()(flaky_connect)
        'connected'
        >>> len(calls)
        3
    """

    attempts: int = 3
    initial_delay_s: float = 0.5
    max_delay_s: float = 10.0
    jitter_s: float = 0.5
    total_delay_s: float | None = 60.0
    retry_on: tuple[type[Exception], ...] = DEFAULT_RETRY_ON
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False, compare=False)
    async_sleep: Callable[[float], Awaitable[None]] = field(default=asyncio.sleep, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise _invalid("attempts", f"must be an int >= 1, got {self.attempts!r}")
        for name in ("initial_delay_s", "max_delay_s", "jitter_s", "total_delay_s"):
            value, allow_none = getattr(self, name), name == "total_delay_s"
            check_seconds(f"RetryPolicy.{name}", value, allow_none=allow_none, allow_zero=True, path=(name,))
        if self.max_delay_s < self.initial_delay_s:
            raise _invalid(
                "max_delay_s",
                f"must be >= initial_delay_s ({self.initial_delay_s:g}), got {self.max_delay_s:g}",
            )
        if not isinstance(self.retry_on, tuple) or not all(
            isinstance(kind, type) and issubclass(kind, Exception) for kind in self.retry_on
        ):
            raise _invalid(
                "retry_on",
                f"must be a tuple of Exception subclasses (never BaseException), got {self.retry_on!r}",
            )

    def is_retryable(self, error: BaseException) -> bool:
        """Whether ``error`` is worth another attempt under this policy (attempts and time aside): it is
        an ``Exception`` (a cancellation or a ``KeyboardInterrupt`` never is, whatever its cause), and
        it, or an error in its ``__cause__`` chain, is one of ``retry_on`` (``is_transient``).
        """
        return isinstance(error, Exception) and is_transient(error, self.retry_on)

    def delay_s(self, attempt: int, jitter: float = 0.0) -> float:
        """The sleep after failed attempt ``attempt`` (1-based), for a jitter draw ``jitter`` in [0, 1].

        The same formula tenacity applies, exposed as a pure function for tests and planning.
        """
        try:
            delay = self.initial_delay_s * 2.0 ** (attempt - 1) + jitter * self.jitter_s
        except OverflowError:
            return self.max_delay_s
        return min(delay, self.max_delay_s)

    def retrying(self, **overrides: Any) -> tenacity.Retrying:
        """A tenacity ``Retrying`` for sync calls: ``policy.retrying()(fn, *args)`` or ``for attempt in ...``.

        ``overrides`` go to tenacity as they are (``before_sleep=...`` to log retries, for instance).
        """
        return tenacity.Retrying(**{**self._tenacity_kwargs(), "sleep": self.sleep, **overrides})

    def async_retrying(self, **overrides: Any) -> tenacity.AsyncRetrying:
        """A tenacity ``AsyncRetrying`` for coroutines: ``await policy.async_retrying()(coro_fn, *args)``."""
        return tenacity.AsyncRetrying(**{**self._tenacity_kwargs(), "sleep": self.async_sleep, **overrides})

    def _tenacity_kwargs(self) -> dict[str, Any]:
        stop: tenacity.stop.stop_base = tenacity.stop_after_attempt(self.attempts)
        if self.total_delay_s is not None:
            stop = stop | tenacity.stop_before_delay(self.total_delay_s)
        return {
            "stop": stop,
            "wait": tenacity.wait_exponential_jitter(
                multiplier=self.initial_delay_s, max=self.max_delay_s, jitter=self.jitter_s
            ),
            "retry": tenacity.retry_if_exception(self.is_retryable),
            # Re-raise the last error itself, not tenacity's RetryError: callers translate it.
            "reraise": True,
        }


def _invalid(option: str, message: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(message, option=f"RetryPolicy.{option}", path=(option,))
