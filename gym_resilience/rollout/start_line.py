"""``StartLine``: the rollouts a batch starts at once send their first prompts to the engine together.

Envs open in pool threads and come back to the event loop in waves; a rollout that went on at once would
send its prompt while its siblings' envs still open, and the later waves would wait behind the engine's
work for the first. So the first rollouts wait at a line, env open and reset, for the others:
``RunnerConfig.start_wait_s`` at most after the first got there (or failed). A rollout that fails before
the line leaves it once its env is closed; rollouts started later and retries go straight on.

The line encodes the prompts it gathered in one tokenizer call as it opens, and can encode the tasks'
prompts ahead while the envs open (:meth:`StartLine.encode_ahead`): a rollout whose env opened with
exactly its task's prompt (the same ``repr``) takes those ids; the runner encodes ahead only while that
pays (:meth:`StartLine.worth_encoding_ahead`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from gym_resilience.rollout.codec import ChatCodec, EncodeQueue
from gym_resilience.tasks import ChatMessage

__all__ = ["StartLine"]


class StartLine:
    """Where the rollouts ``prompts`` names (index: its task's prompt) wait for each other before their
    first prompt, ``wait_s`` at most after the first arrives or leaves, their prompts encoded by
    ``codec`` as it opens or, asked to, ahead (event loop only)."""

    def __init__(self, prompts: Mapping[int, Sequence[ChatMessage]], wait_s: float, codec: ChatCodec) -> None:
        self._task_prompts = prompts  # only a list (of messages) can match an opening
        self._missing = set(prompts)
        self._wait_s = wait_s
        self._codec = codec
        self._prompts: EncodeQueue | None = None  # the arrivals' first prompts, until the line opens
        # Encoded ahead, until the line opens: each rollout's task prompt's repr as it was encoded, and
        # the ids of each repr whose encoding succeeded (a failed one is encoded again at the line).
        self._ahead: dict[int, str] = {}
        self._encoded: dict[str, list[int]] = {}
        self._interrupted: BaseException | None = None  # what interrupted the encoding ahead
        self._ready: list[tuple[asyncio.Future[list[int]], list[int]]] = []  # arrivals with ids already
        self._deadline: asyncio.TimerHandle | None = None
        self.arrived = 0  # rollouts that brought their first prompt to the line
        self.matched = 0  # ... that prompt being their task's
        if len(self._missing) <= 1 or wait_s <= 0:  # nobody to wait for, or no wait
            self._release()

    def encode_ahead(self) -> None:
        """Encode the task prompts of the rollouts still to come in the event loop's next pass: once the
        rollouts started in this one have sent their envs to the pool threads to open."""
        if self._missing:
            asyncio.get_running_loop().call_soon(self._encode_ahead)

    def worth_encoding_ahead(self, default: bool) -> bool:
        """Whether at least half the rollouts that reached the line opened with their task's prompt
        (encoding ahead then saves more than it wastes); ``default`` when none reached it."""
        return self.matched * 2 >= self.arrived if self.arrived else default

    async def first_prompt(self, index: int, messages: Sequence[ChatMessage]) -> list[int]:
        """The ids of rollout ``index``'s first prompt, its env open: if it is one of the line's and has
        not left it (a retry), once the others are there or the wait is over, encoded with theirs
        (or ahead); any other rollout's at once, as :meth:`ChatCodec.encode_prompt` encodes it."""
        if index not in self._missing:
            return await self._codec.encode_prompt(messages)
        self.arrived += 1
        if self._interrupted is not None:  # a KeyboardInterrupt: raised in each rollout, as at the line
            raise self._interrupted
        opening = list(messages)
        ids = self._encoded_ahead(index, opening)
        if ids is not None:
            prompt: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
            self._ready.append((prompt, ids))
        else:
            if self._prompts is None:
                self._prompts = self._codec.held_queue()
            prompt = self._prompts.add(opening)
        self.leave(index)  # the last to arrive opens the line, and the prompt is encoded by then
        return list(await prompt)

    def leave(self, index: int) -> None:
        """Rollout ``index`` waits no more: ready, or failed before it (again and again is fine)."""
        if index not in self._missing:
            return
        self._missing.remove(index)
        if not self._missing:
            self._release()
        elif self._deadline is None:
            self._deadline = asyncio.get_running_loop().call_later(self._wait_s, self._release)

    def _encoded_ahead(self, index: int, opening: list[ChatMessage]) -> list[int] | None:
        """The ids encoded ahead for ``index``'s task prompt, if ``opening`` is that prompt: equal, and
        rendered alike (``1`` and ``True`` are equal, not alike), counted whether encoded ahead or not."""
        task_prompt = self._task_prompts.get(index)
        if not isinstance(task_prompt, list) or opening != task_prompt:  # most that differ, differ here
            return None
        key = self._ahead.pop(index, None)
        if repr(opening) != (repr(task_prompt) if key is None else key):
            return None
        self.matched += 1
        return None if key is None else self._encoded.get(key)  # None: not encoded ahead, or it failed

    def _encode_ahead(self) -> None:
        prompts: dict[str, list[ChatMessage]] = {}  # each distinct prompt once
        for index in self._missing:
            prompt = self._task_prompts.get(index)
            if isinstance(prompt, list):
                self._ahead[index] = key = repr(prompt)
                prompts.setdefault(key, list(prompt))
        for key, outcome in zip(prompts, self._codec.encode_each(list(prompts.values())), strict=True):
            if isinstance(outcome, list):
                self._encoded[key] = outcome
            elif not isinstance(outcome, Exception):
                self._interrupted = outcome

    def _release(self) -> None:
        self._missing.clear()
        self._ahead.clear()
        self._encoded.clear()
        if self._deadline is not None:
            self._deadline.cancel()
        ready, self._ready = self._ready, []
        for prompt, ids in ready:
            if not prompt.done():  # its rollout was cancelled meanwhile
                prompt.set_result(ids)
        prompts, self._prompts = self._prompts, None
        if prompts is not None:
            self._codec.encode_queued(prompts)
