"""The runner's env pool (``EnvPool``) and the chat codec's batched encoding (``ChatCodec.encode_*``)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any

import pytest

from gym_resilience.models import build_tiny_model
from gym_resilience.rollout import ChatCodec, EnvPool
from gym_resilience.tasks import ChatMessage

SETTLE_S = 10.0

_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("test_pool_var", default="unset")


async def test_a_call_runs_in_a_pool_thread_in_the_context_it_was_submitted_from() -> None:
    pool = EnvPool(2, name="test-pool")
    _VAR.set("rollout 7")
    try:
        name, value = await pool.submit(lambda: (threading.current_thread().name, _VAR.get()))
    finally:
        pool.shutdown()
    assert (name, value) == ("test-pool_0", "rollout 7")


async def test_a_call_cancelled_before_a_thread_takes_it_never_runs() -> None:
    pool = EnvPool(1, name="test-pool")
    release, ran = threading.Event(), []
    busy = pool.submit(lambda: release.wait(SETTLE_S))
    queued = pool.submit(lambda: ran.append("queued"))
    queued.cancel()
    release.set()
    assert await busy is True
    after = await pool.submit(lambda: ran.append("after"))
    pool.shutdown()
    assert after is None and ran == ["after"]


async def test_calls_queued_before_shutdown_still_run_and_then_every_thread_ends() -> None:
    pool = EnvPool(2, name="test-pool-end")
    release, ran = threading.Event(), []
    calls = [pool.submit(lambda i=i: (release.wait(SETTLE_S), ran.append(i))) for i in range(4)]
    pool.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: None)
    release.set()
    await asyncio.gather(*calls)
    assert sorted(ran) == [0, 1, 2, 3]
    for thread in [t for t in threading.enumerate() if t.name.startswith("test-pool-end")]:
        await asyncio.to_thread(thread.join, SETTLE_S)
        assert not thread.is_alive()


async def test_an_exception_in_a_call_is_raised_where_it_is_awaited() -> None:
    pool = EnvPool(1, name="test-pool")

    def fail() -> None:
        raise ConnectionError("sandbox went away")

    try:
        with pytest.raises(ConnectionError, match="sandbox went away"):
            await pool.submit(fail)
    finally:
        pool.shutdown()


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
