"""A scripted engine and a character tokenizer: test doubles for unit tests of runner logic.

Every capability is also tested against real vLLM; these exist so logic tests run in milliseconds.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gym_resilience.engines.base import Generation, Sampling

__all__ = ["CharTokenizer", "Script", "ScriptedEngine", "echo_script"]


class CharTokenizer:
    """A tokenizer with one token per character (its code point + 8) and ChatML-like markers.

    Ids 0-7 are special: 0 pad, 1 bos, 2 ``<|im_start|>``, 3 ``<|im_end|>`` (eos).
    """

    pad_token_id: int | None = 0
    eos_token_id: int | None = 3
    _offset = 8

    def encode(self, text: str, **kwargs: object) -> list[int]:
        return [ord(char) + self._offset for char in text]

    def decode(self, token_ids: list[int], **kwargs: object) -> str:
        return "".join(chr(token - self._offset) for token in token_ids if token >= self._offset)

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: object) -> list[int]:
        ids: list[int] = []
        for message in conversation:
            ids += [2, *self.encode(f"{message['role']}\n{message['content']}"), 3, *self.encode("\n")]
        if kwargs.get("add_generation_prompt"):
            ids += [2, *self.encode("assistant\n")]
        return ids


Script = Callable[[list[int], Sampling, int], Generation | Awaitable[Generation]]
"""``script(prompt_ids, sampling, call_index)`` returns (or awaits to) a Generation, or raises."""


def echo_script(prompt_ids: list[int], sampling: Sampling, call_index: int) -> Generation:
    """Deterministic text from the prompt's hash: same prompt, same answer, like greedy decoding; it ends
    at the first of ``sampling.stop_token_ids`` as vLLM's would."""
    digest = hashlib.blake2b(bytes(str(prompt_ids), "ascii"), digest_size=32).digest()
    answer = [ord("a") + byte % 26 + CharTokenizer._offset for byte in digest[: 8 + digest[0] % 8]]
    answer.append(CharTokenizer.eos_token_id or 0)
    stops = set(sampling.stop_token_ids)
    end = next((index + 1 for index, token in enumerate(answer) if token in stops), len(answer))
    answer = answer[:end]  # a stop token ends the answer, kept, as vLLM keeps it
    token_ids = answer[: sampling.max_tokens]
    finished = len(token_ids) == len(answer)
    logprobs = [-0.5] * len(token_ids) if sampling.logprobs else None
    return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason="stop" if finished else "length")


@dataclass
class ScriptedEngine:
    """An ``Engine`` whose generations come from a script; counts calls and records prompts.

    ``delay_s`` simulates generation latency (``asyncio.sleep``, so cancellation works as with vLLM).
    """

    script: Script = echo_script
    delay_s: float = 0.0
    tokenizer: CharTokenizer = field(default_factory=CharTokenizer)
    calls: int = 0
    cancelled: int = 0

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        call_index = self.calls
        self.calls += 1
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            result = self.script(list(prompt_ids), sampling, call_index)
            if isinstance(result, Generation):
                return result
            return await result
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
