"""The chat codec's batched encoding (``ChatCodec.encode_*``), on the tiny model's real tokenizer."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gym_resilience.models import build_tiny_model
from gym_resilience.rollout import ChatCodec
from gym_resilience.tasks import ChatMessage


class CountingTokenizer:
    """A real Hugging Face tokenizer that counts its chat-template calls and rejects one message."""

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        self.inner = AutoTokenizer.from_pretrained(build_tiny_model())
        self.pad_token_id = self.inner.pad_token_id
        self.eos_token_id = self.inner.eos_token_id
        self.calls: list[int] = []  # the number of chats in each call

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> object:
        batch = bool(conversation) and isinstance(conversation[0], list)
        chats = conversation if batch else [conversation]
        self.calls.append(len(chats))
        if any(message["content"] == "the template rejects this" for chat in chats for message in chat):
            raise ValueError("the template rejects this message")
        return self.inner.apply_chat_template(conversation, **kwargs)

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        return str(self.inner.decode(token_ids, **kwargs))

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return list(self.inner.encode(text, **kwargs))


def user(content: str) -> list[ChatMessage]:
    return [{"role": "user", "content": content}]


async def test_conversations_asked_for_in_one_pass_are_encoded_in_one_call_each_distinct_one_once() -> None:
    tokenizer = CountingTokenizer()
    codec = ChatCodec(tokenizer)
    tokenizer.calls.clear()
    prompts = [user("task 0"), user("task 1"), user("task 0"), user("a longer task, number 2")]
    encoded = await asyncio.gather(
        *(codec.encode_prompt(prompt) for prompt in prompts), codec.encode_observation(user("go on"))
    )
    assert tokenizer.calls == [4]  # three distinct prompts and one observation, in one call
    assert encoded == [*(codec.prompt(prompt) for prompt in prompts), codec.observation(user("go on"))]


async def test_a_conversation_the_template_rejects_fails_only_the_rollout_that_asked_for_it() -> None:
    codec = ChatCodec(CountingTokenizer())
    good, bad = await asyncio.gather(
        codec.encode_prompt(user("task 0")),
        codec.encode_prompt(user("the template rejects this")),
        return_exceptions=True,
    )
    assert good == codec.prompt(user("task 0"))
    assert isinstance(bad, ValueError) and str(bad) == "the template rejects this message"


async def test_a_rollout_cancelled_while_its_prompt_is_encoded_leaves_the_others_theirs() -> None:
    codec = ChatCodec(CountingTokenizer())
    cancelled = asyncio.ensure_future(codec.encode_prompt(user("task 0")))
    kept = asyncio.ensure_future(codec.encode_prompt(user("task 1")))
    await asyncio.sleep(0)
    cancelled.cancel()
    assert await kept == codec.prompt(user("task 1"))
    assert cancelled.cancelled()


# Decoding generated ids: the Rust tokenizer's own decode where Hugging Face's wrapper adds nothing.


def tiny_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny_model())


TOKENIZER = tiny_tokenizer()


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_decoding_gives_what_the_hugging_face_tokenizer_gives_skipping_special_tokens(
    data: st.DataObject,
) -> None:
    tokenizer = TOKENIZER
    special = sorted(tokenizer.all_special_ids)
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1) | st.sampled_from(special), max_size=80))
    assert ChatCodec(tokenizer).decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_that_decodes_its_own_way_is_decoded_its_way() -> None:
    tokenizer = tiny_tokenizer()

    class Shouting(type(tokenizer)):  # type: ignore[misc]
        def decode(self, token_ids: Any, **kwargs: Any) -> str:
            return str(super().decode(token_ids, **kwargs)).upper()

    tokenizer.__class__ = Shouting
    ids = tokenizer.encode("hello there", add_special_tokens=False)
    assert ChatCodec(tokenizer).decode(ids) == "HELLO THERE"
    tokenizer.__class__ = Shouting.__mro__[1]
    tokenizer.clean_up_tokenization_spaces = True  # the wrapper edits the text after the Rust decode
    spaced = tokenizer.encode("a , b", add_special_tokens=False)
    assert ChatCodec(tokenizer).decode(spaced) == tokenizer.decode(spaced, skip_special_tokens=True)
