"""Chat messages to token ids and back: how a conversation becomes a prompt and an observation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gym_resilience.engines.base import Tokenizer
from gym_resilience.tasks import ChatMessage

__all__ = ["ChatCodec", "as_messages", "chat_ids"]

_BASE_CONVERSATION: list[ChatMessage] = [
    {"role": "system", "content": "base"},
    {"role": "user", "content": "base"},
]


def chat_ids(
    tokenizer: Tokenizer, messages: Sequence[ChatMessage], *, add_generation_prompt: bool
) -> list[int]:
    """Token ids of a chat through the tokenizer's template, whatever container it returns."""
    ids = tokenizer.apply_chat_template(
        list(messages), tokenize=True, add_generation_prompt=add_generation_prompt
    )
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return [int(token) for token in ids]  # type: ignore[attr-defined]


class ChatCodec:
    """Turns chat messages into token ids and generated ids into text, for one tokenizer.

    Observations are encoded as a continuation of the conversation: the template applied to a fixed
    base conversation plus the new messages, minus the base's own ids (SkyRL's generator's method).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        if eos is None or pad is None:
            raise ValueError("the tokenizer has no eos_token_id: cannot end turns or build placeholders")
        self.eos_token_id: int = eos
        self.pad_token_id: int = pad
        self._base_ids = chat_ids(tokenizer, _BASE_CONVERSATION, add_generation_prompt=False)

    def prompt(self, messages: Sequence[ChatMessage]) -> list[int]:
        return chat_ids(self.tokenizer, messages, add_generation_prompt=True)

    def observation(self, messages: Sequence[ChatMessage]) -> list[int]:
        ids = chat_ids(self.tokenizer, [*_BASE_CONVERSATION, *messages], add_generation_prompt=True)
        if ids[: len(self._base_ids)] != self._base_ids:
            raise ValueError("the chat template is not prefix-stable: cannot encode observations")
        return ids[len(self._base_ids) :]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def as_messages(observation: object) -> list[ChatMessage]:
    """An env's observation as chat messages: a string is one user message."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, Mapping):
        return [dict(observation)]
    if isinstance(observation, Sequence) and all(isinstance(m, Mapping) for m in observation):
        return [dict(m) for m in observation]
    raise TypeError(
        f"a text env must return chat messages or a string, got {type(observation).__name__}: "
        f"{observation!r:.80}"
    )
