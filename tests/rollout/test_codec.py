"""The chat codec's batched encoding (``ChatCodec.encode_*``) and its decoding, on the tiny model's real
tokenizer."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gym_resilience.models import build_tiny_model
from gym_resilience.rollout import ChatCodec
from gym_resilience.rollout.codec import chat_ids
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


# Encoding a batch: the Rust tokenizer's own batch encode where Hugging Face's wrapper adds nothing.

MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": st.lists(
            st.text(max_size=12) | st.sampled_from(["<|im_start|>", "<|im_end|>", " ", "\n", "é"]), max_size=6
        ).map("".join),
    }
)


def encoded_together(codec: ChatCodec, chats: list[list[ChatMessage]]) -> list[list[int]]:
    async def encode() -> list[list[int]]:
        return list(await asyncio.gather(*(codec.encode_prompt(chat) for chat in chats)))

    return asyncio.run(encode())


@settings(max_examples=150, deadline=None)
@given(chats=st.lists(st.lists(MESSAGE, min_size=1, max_size=3), min_size=2, max_size=6))
def test_chats_encoded_together_are_the_ids_each_gets_from_the_template_alone(
    chats: list[list[ChatMessage]],
) -> None:
    codec = ChatCodec(TOKENIZER)
    assert codec._encode_texts is not None and codec._takes_batches  # the Rust tokenizer's batch encode
    assert encoded_together(codec, chats) == [
        list(TOKENIZER.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)["input_ids"])
        for chat in chats
    ]


def test_chats_encoded_together_are_not_truncated_when_the_rust_tokenizer_was_set_to_truncate() -> None:
    tokenizer = tiny_tokenizer()
    codec = ChatCodec(tokenizer)
    chats = [user("a task with quite a few words in it"), user("another one, as long as that one")]
    expected = [codec.prompt(chat) for chat in chats]
    for _ in range(2):  # the template's own call turns truncation off again; set it each time
        tokenizer.backend_tokenizer.enable_truncation(max_length=3)
        assert encoded_together(codec, chats) == expected


def test_chats_encoded_together_split_special_tokens_when_the_tokenizer_is_told_to() -> None:
    tokenizer = tiny_tokenizer()
    codec = ChatCodec(tokenizer)
    chats = [user("task 0"), user("task number 1")]
    whole = encoded_together(codec, chats)
    tokenizer.split_special_tokens = True
    split = [codec.prompt(chat) for chat in chats]
    assert split != whole
    # The wrapper tells the Rust tokenizer to split them only when it encodes: not yet, here.
    tokenizer.backend_tokenizer.encode_special_tokens = False
    assert encoded_together(codec, chats) == split
    assert encoded_together(codec, chats) == split  # and again, once the Rust tokenizer splits them too


def test_a_tokenizer_that_encodes_its_own_way_is_encoded_its_way_in_a_batch_too() -> None:
    tokenizer = tiny_tokenizer()

    batches: list[int] = []

    class Marking(type(tokenizer)):  # type: ignore[misc]
        """Ends every encoding with the pad id."""

        def _encode_plus(self, *args: Any, **kwargs: Any) -> Any:
            encoded = super()._encode_plus(*args, **kwargs)
            ids = encoded["input_ids"]
            batched = bool(ids) and isinstance(ids[0], list)
            batches.append(len(ids) if batched else 1)
            rows = [[*row, self.pad_token_id] for row in (ids if batched else [ids])]
            encoded["input_ids"] = rows if batched else rows[0]
            return encoded

    tokenizer.__class__ = Marking
    codec = ChatCodec(tokenizer)
    chats = [user("task 0"), user("task number 1")]
    batches.clear()
    together = encoded_together(codec, chats)
    assert batches == [2]  # still one call for the batch, through the subclass
    assert together == [codec.prompt(chat) for chat in chats]
    assert all(row[-1] == tokenizer.pad_token_id for row in together)


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


@pytest.mark.parametrize("observation", [[{"role": "user", "content": "Try again."}], []])
def test_a_turn_after_an_observation_is_the_template_of_the_whole_conversation(
    observation: list[ChatMessage],
) -> None:
    """SkyRL's generator's token-in-token-out: the prompt, the generated reply (ending at the end-of-turn
    token the engine stops at) and the observation's ids are the template's ids for the conversation,
    including what the template writes after an end-of-turn token (ChatML's newline)."""
    codec = ChatCodec(TOKENIZER)
    prompt: list[ChatMessage] = [{"role": "user", "content": "What is 6 x 7?"}]
    reply = "It is 42."
    generated = [*TOKENIZER.encode(reply, add_special_tokens=False), codec.eos_token_id]
    turn_two = codec.prompt(prompt) + generated + codec.observation(observation)
    conversation = [*prompt, {"role": "assistant", "content": reply}, *observation]
    assert turn_two == chat_ids(TOKENIZER, conversation, add_generation_prompt=True)


async def test_rollouts_asking_for_the_same_rejected_conversation_each_get_an_error_of_their_own() -> None:
    """The samples of one task ask for one conversation, encoded once; what one rollout's teardown notes on
    its error must not show on another's."""
    codec = ChatCodec(CountingTokenizer())
    bad = user("the template rejects this")
    errors = await asyncio.gather(*(codec.encode_prompt(bad) for _ in range(3)), return_exceptions=True)
    assert len({id(error) for error in errors}) == 3
    assert all(isinstance(e, ValueError) and str(e) == "the template rejects this message" for e in errors)
    errors[0].add_note("closing the env also failed")
    assert not hasattr(errors[1], "__notes__") and not hasattr(errors[2], "__notes__")
