"""Chat messages to token ids and back: how a conversation becomes a prompt and an observation."""

from __future__ import annotations

import asyncio
import copy
import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gym_resilience.cleanup import settable
from gym_resilience.engines.base import Tokenizer
from gym_resilience.tasks import ChatMessage

__all__ = ["ChatCodec", "EncodeQueue", "as_messages", "chat_ids"]

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

    The rollouts of a batch ask for their encodings through :meth:`encode_prompt` and
    :meth:`encode_observation`: the conversations asked for in one pass of the event loop are encoded
    together, each distinct one once, in one tokenizer call when the tokenizer takes a batch of
    conversations (a Hugging Face tokenizer does). Encoded one by one, 64 prompts cost about twice the
    CPU, and each call lets the engine's thread take the interpreter in the middle of the burst of
    requests that starts a batch.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        if eos is None or pad is None:
            raise ValueError("the tokenizer has no eos_token_id: cannot end turns or build placeholders")
        self.eos_token_id: int = eos
        self.pad_token_id: int = pad
        self._base_ids = _through_last(
            eos, chat_ids(tokenizer, _BASE_CONVERSATION, add_generation_prompt=False)
        )
        self._encode_texts = _text_encoder(tokenizer)
        self._takes_batches = _takes_batches(tokenizer, self._encode_texts)
        if self._encode_texts is not None and not self._takes_batches:  # the template's own way, then
            self._encode_texts = None
            self._takes_batches = _takes_batches(tokenizer, None)
        self._queue: EncodeQueue | None = None
        self._decode = _decoder(tokenizer)

    def prompt(self, messages: Sequence[ChatMessage]) -> list[int]:
        return chat_ids(self.tokenizer, messages, add_generation_prompt=True)

    def observation(self, messages: Sequence[ChatMessage]) -> list[int]:
        return self._continuation(self.prompt([*_BASE_CONVERSATION, *messages]))

    async def encode_prompt(self, messages: Sequence[ChatMessage]) -> list[int]:
        """:meth:`prompt`, encoded with the other conversations asked for in this pass of the loop."""
        return list(await self._enqueue(list(messages)))

    async def encode_observation(self, messages: Sequence[ChatMessage]) -> list[int]:
        """:meth:`observation`, encoded with the other conversations asked for in this pass of the loop."""
        return self._continuation(await self._enqueue([*_BASE_CONVERSATION, *messages]))

    async def skyrl_observation(self, messages: Sequence[ChatMessage], *, done: bool) -> list[int]:
        """An observation's ids as SkyRL's generator makes them: the generation prompt only while the
        episode goes on, and with no messages the generation prompt alone (nothing once done)."""
        if not messages:
            return [] if done else list(self.generation_prompt_ids)
        if not done:
            return await self.encode_observation(messages)
        conversation = [*_BASE_CONVERSATION, *messages]
        return self._continuation(chat_ids(self.tokenizer, conversation, add_generation_prompt=False))

    @functools.cached_property
    def generation_prompt_ids(self) -> list[int]:
        """What the template adds for ``add_generation_prompt`` after a message (SkyRL's method)."""
        empty: list[ChatMessage] = [{"role": "user", "content": ""}]
        bare = chat_ids(self.tokenizer, empty, add_generation_prompt=False)
        return chat_ids(self.tokenizer, empty, add_generation_prompt=True)[len(bare) :]

    def decode(self, token_ids: list[int]) -> str:
        """Generated ids as text, special tokens skipped."""
        return self._decode(token_ids)

    def held_queue(self) -> EncodeQueue:
        """A queue whose conversations are encoded when :meth:`encode_queued` is called with it, rather
        than at the end of the loop's pass: the start line's, for its rollouts' first prompts."""
        return EncodeQueue(asyncio.get_running_loop())

    def encode_queued(self, queue: EncodeQueue) -> None:
        """Encode what ``queue`` holds and resolve its futures (never raises)."""
        self._flush(queue)

    def _continuation(self, ids: list[int]) -> list[int]:
        if ids[: len(self._base_ids)] != self._base_ids:
            raise ValueError("the chat template is not prefix-stable: cannot encode observations")
        return ids[len(self._base_ids) :]

    def _enqueue(self, conversation: list[ChatMessage]) -> asyncio.Future[list[int]]:
        loop = asyncio.get_running_loop()
        if self._queue is None or self._queue.loop is not loop:
            self._queue = EncodeQueue(loop)
            loop.call_soon(self._flush, self._queue)
        return self._queue.add(conversation)

    def _flush(self, queue: EncodeQueue) -> None:
        """Encode what was queued (in a callback of the loop: it must resolve every future, never raise)."""
        if self._queue is queue:
            self._queue = None
        waiting = queue.waiting()
        if not waiting:
            return
        encoded = self.encode_each([conversation for conversation, _ in waiting.values()])
        for (_, futures), outcome in zip(waiting.values(), encoded, strict=True):
            for index, future in enumerate(futures):
                if future.done():  # its rollout was cancelled meanwhile
                    continue
                if isinstance(outcome, BaseException):
                    # Rollouts that asked for the same conversation (the samples of one task) each get
                    # an error of their own: the notes one adds in its teardown are not on another's.
                    error = outcome if index == 0 else _copy_of(outcome)
                    future.set_exception(settable(error, "the chat template"))
                else:
                    future.set_result(outcome)

    def encode_each(self, conversations: list[list[ChatMessage]]) -> list[list[int] | BaseException]:
        """Each conversation's prompt ids, in one tokenizer call where it takes batches, or what its
        encoding raised (never raises)."""
        if self._takes_batches and len(conversations) > 1:
            try:
                return list(_batch_ids(self.tokenizer, conversations, self._encode_texts))
            except Exception:  # one conversation the template rejects: one by one, to tell which
                pass
            except BaseException as exc:  # KeyboardInterrupt: every rollout that asked raises it
                return [exc] * len(conversations)
        return [self._one(conversation) for conversation in conversations]

    def _one(self, conversation: list[ChatMessage]) -> list[int] | BaseException:
        try:
            return self.prompt(conversation)
        except BaseException as exc:  # for the rollout that asked: raised where it awaits its encoding
            return exc


def _copy_of(error: BaseException) -> BaseException:
    """A copy of ``error`` with its cause, context, traceback and a list of notes of its own; ``error``
    itself when it cannot be copied (an ``__init__`` its arguments do not fit)."""
    try:
        twin = copy.copy(error)
    except Exception:
        return error
    twin.__cause__, twin.__context__ = error.__cause__, error.__context__
    twin.__suppress_context__ = error.__suppress_context__
    twin.__traceback__ = error.__traceback__
    if hasattr(error, "__notes__"):
        twin.__notes__ = list(error.__notes__)
    return twin


def _through_last(token: int, ids: list[int]) -> list[int]:
    """``ids`` up to and including the last ``token`` (all of them without one). The base conversation's
    ids end at its last end-of-turn token, as in SkyRL's generator: what a template puts after one (a
    ChatML newline) starts the next observation's ids, since the engine, which stops at that token,
    never generates it."""
    if token not in ids:
        return ids
    return ids[: len(ids) - ids[::-1].index(token)]


class EncodeQueue:
    """The conversations asked for in one pass of an event loop, each distinct one once (by its repr)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._waiting: dict[str, tuple[list[ChatMessage], list[asyncio.Future[list[int]]]]] = {}

    def add(self, conversation: list[ChatMessage]) -> asyncio.Future[list[int]]:
        """A future of ``conversation``'s ids."""
        future: asyncio.Future[list[int]] = self.loop.create_future()
        self._waiting.setdefault(repr(conversation), (conversation, []))[1].append(future)
        return future

    def waiting(self) -> dict[str, tuple[list[ChatMessage], list[asyncio.Future[list[int]]]]]:
        """What is still awaited: conversations whose rollouts were all cancelled are dropped."""
        return {
            key: (conversation, futures)
            for key, (conversation, futures) in self._waiting.items()
            if not all(future.done() for future in futures)
        }


TextEncoder = Callable[[list[str]], list[list[int]]]
"""Token ids of chats the template rendered as text, as the template's own tokenizing gives them."""


def _batch_ids(
    tokenizer: Tokenizer, conversations: list[list[ChatMessage]], encode_texts: TextEncoder | None
) -> list[list[int]]:
    """Token ids of several chats in one call of the template, each as its own call would give them.

    With ``encode_texts`` (see :func:`_text_encoder`) the template renders the chats as text and
    ``encode_texts`` encodes them; otherwise the template tokenizes them.
    """
    if encode_texts is not None:
        texts = tokenizer.apply_chat_template(
            conversations,  # type: ignore[arg-type]  # a Hugging Face tokenizer takes a list of chats
            tokenize=False,
            add_generation_prompt=True,
        )
        rows = encode_texts(texts)  # type: ignore[arg-type]  # one rendered text per chat
    else:
        batch = tokenizer.apply_chat_template(
            conversations,  # type: ignore[arg-type]
            tokenize=True,
            add_generation_prompt=True,
        )
        if isinstance(batch, Mapping):
            batch = batch["input_ids"]
        rows = [[int(token) for token in row] for row in batch]  # type: ignore[attr-defined]
    if len(rows) != len(conversations):
        raise ValueError(f"{len(conversations)} chats encoded as {len(rows)}")
    return rows


def _takes_batches(tokenizer: Tokenizer, encode_texts: TextEncoder | None) -> bool:
    """Whether the tokenizer encodes a batch of chats as it encodes each alone (tried on two of different
    lengths, so that padding would show)."""
    chats = [_BASE_CONVERSATION, [*_BASE_CONVERSATION, {"role": "assistant", "content": "base base"}]]
    try:
        return _batch_ids(tokenizer, chats, encode_texts) == [
            chat_ids(tokenizer, chat, add_generation_prompt=True) for chat in chats
        ]
    except Exception:  # a tokenizer that takes one chat at a time
        return False


# What Hugging Face's wrapper runs, in transformers 5 and 4, between the template's text and the Rust
# tokenizer's batch encode: a class (or instance) that changes none of them encodes as the Rust one does.
_ENCODE_METHODS = (
    "apply_chat_template",
    "__call__",
    "_call_one",
    "batch_encode_plus",
    "_batch_encode_plus",
    "_encode_plus",
    "set_truncation_and_padding",
)


def _text_encoder(tokenizer: Tokenizer) -> TextEncoder | None:
    """For a Hugging Face fast tokenizer that keeps the wrapper's own encoding methods, the Rust
    tokenizer's batch encode, whenever the Rust tokenizer pads and truncates nothing and splits special
    tokens as the wrapper would have it; the wrapper's own encode otherwise (as the template's tokenizing
    does: no padding, no truncation, no special tokens added).

    The wrapper turns every row's Rust encoding into a dict of Python lists (offsets, masks, type ids)
    that nothing here reads: for 64 prompts, about 1 of the 10 ms the runner spends before a batch's last
    request reaches the engine.
    """
    if not _plain_fast(tokenizer, *_ENCODE_METHODS):
        return None
    wrapper: Any = tokenizer

    def encode(texts: list[str]) -> list[list[int]]:
        backend = wrapper.backend_tokenizer
        if (
            backend.padding is None
            and backend.truncation is None
            and backend.encode_special_tokens == bool(wrapper.split_special_tokens)
        ):
            return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]
        # The wrapper, asked for no padding and no truncation, turns both off (and sets the split) first.
        return [list(row) for row in wrapper(texts, add_special_tokens=False)["input_ids"]]

    return encode


def _decoder(tokenizer: Tokenizer) -> Callable[[list[int]], str]:
    """The tokenizer's ``decode``, skipping special tokens; for a Hugging Face fast tokenizer that adds
    nothing to its Rust tokenizer's own decode (its class keeps the wrapper's, no space clean-up), that one.

    Hugging Face's wrapper first checks every id in Python: 10 of the 25 us it takes to decode 64 tokens,
    on the event loop, for every turn of every rollout.
    """
    plain = functools.partial(tokenizer.decode, skip_special_tokens=True)
    if not _plain_fast(tokenizer, "decode", "_decode"):
        return plain
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return plain
    return functools.partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=True)  # type: ignore[attr-defined]


def _plain_fast(tokenizer: Tokenizer, *methods: str) -> bool:
    """Whether ``tokenizer`` is a Hugging Face fast tokenizer whose class and instance keep the wrapper's
    own ``methods``, so that what they do on top of the Rust tokenizer is known."""
    # A Hugging Face tokenizer means transformers is imported already; nothing else needs it imported.
    fast = getattr(sys.modules.get("transformers"), "PreTrainedTokenizerFast", None)
    if fast is None or not isinstance(tokenizer, fast):
        return False
    kind, patched = type(tokenizer), vars(tokenizer)
    return all(
        getattr(kind, method, None) is getattr(fast, method, None) and method not in patched
        for method in methods
    )


def as_messages(observation: object) -> list[ChatMessage]:
    """An env's observation as chat messages: a string is one user message."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if type(observation) is list and all(type(m) is dict for m in observation):  # the common case, at once
        return [dict(m) for m in observation]
    if isinstance(observation, Mapping):
        return [dict(observation)]
    if isinstance(observation, Sequence) and all(isinstance(m, Mapping) for m in observation):
        return [dict(m) for m in observation]
    raise TypeError(
        f"a text env must return chat messages or a string, got {type(observation).__name__}: "
        f"{observation!r:.80}"
    )
