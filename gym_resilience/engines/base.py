"""The engine protocol: token ids in, token ids, logprobs and a finish reason out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

__all__ = ["Engine", "FinishReason", "Generation", "Sampling", "Tokenizer"]

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class Sampling:
    """How to sample one generation. ``temperature=0.0`` is greedy (deterministic).

    ``logprobs`` asks for the sampled tokens' logprobs; ``stop_token_ids`` end generation (the
    tokenizer's eos always does).
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: bool = False
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Generation:
    """One generation: the sampled token ids, their logprobs (when asked for) and why it stopped.

    ``text`` is the engine's own decoding of the ids, when it gives one (the env then gets it as the
    action; otherwise the runner decodes the ids). ``appended_eos`` says the last id is an end-of-turn
    token the engine's wrapper appended and the model did not generate (SkyRL's generator does so after
    a stop string): it is loss-masked.
    """

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: FinishReason
    text: str | None = None
    appended_eos: bool = False


@runtime_checkable
class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the runner uses."""

    pad_token_id: int | None
    eos_token_id: int | None

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: object) -> object: ...

    def decode(self, token_ids: list[int], **kwargs: object) -> str: ...

    def encode(self, text: str, **kwargs: object) -> list[int]: ...


@runtime_checkable
class Engine(Protocol):
    """Anything that generates from token ids; the runner needs nothing else.

    ``generate`` must be safe to call concurrently, and cancelling the awaiting task must abort the
    request in the engine.
    """

    @property
    def tokenizer(self) -> Tokenizer: ...

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation: ...
