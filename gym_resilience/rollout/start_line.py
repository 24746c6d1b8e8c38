"""``StartLine``: the rollouts a batch starts at once send their first prompts to the engine together.

Envs open in pool threads and come back to the event loop in waves, as threads finish. A rollout that
went on at once would encode its prompt and send it while its siblings' envs are still opening; the
later waves then wait on the event loop behind the engine's work for the first (adding its requests,
handling its first outputs), and reach it later: in a trace of 8 batches of 64 rollouts on vLLM, a
batch whose envs came back in waves sent its last request up to 20 ms after one whose envs came back
at once. Its generation ends that much later, and the batch with it.

So the first rollouts wait at a start line, once their env is open and reset, for the siblings still
opening theirs: ``RunnerConfig.start_wait_s`` at most after the first got there (or failed), so one
slow or stuck reset holds up the others that long at worst. A rollout that fails before the line
leaves it once its env is closed. Rollouts started later (as slots free up under ``max_concurrency``)
and retries are not on the line: they go straight on.

Each rollout brings its first prompt to the line, and the line encodes them all in one tokenizer call
as it opens: a rollout waits once, for its prompt's ids, rather than for the line and then for its
encoding (a wake-up of each task fewer: about 1 ms of a 64-rollout batch).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from gym_resilience.rollout.codec import ChatCodec, EncodeQueue
from gym_resilience.tasks import ChatMessage

__all__ = ["StartLine"]


class StartLine:
    """Where the rollouts ``indices`` wait for each other before their first prompt, ``wait_s`` at most
    after the first arrives or leaves, their prompts encoded by ``codec`` as it opens (event loop only)."""

    def __init__(self, indices: Iterable[int], wait_s: float, codec: ChatCodec) -> None:
        self._missing = set(indices)
        self._wait_s = wait_s
        self._codec = codec
        self._prompts: EncodeQueue | None = None  # the arrivals' first prompts, until the line opens
        self._deadline: asyncio.TimerHandle | None = None
        if len(self._missing) <= 1 or wait_s <= 0:  # nobody to wait for, or no wait
            self._release()

    async def first_prompt(self, index: int, messages: Sequence[ChatMessage]) -> list[int]:
        """The ids of rollout ``index``'s first prompt, its env open: if it is one of the line's and has
        not left it (a retry), once the others are there or the wait is over, encoded with theirs;
        any other rollout's at once, as :meth:`ChatCodec.encode_prompt` encodes it."""
        if index not in self._missing:
            return await self._codec.encode_prompt(messages)
        if self._prompts is None:
            self._prompts = self._codec.held_queue()
        prompt = self._prompts.add(list(messages))
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

    def _release(self) -> None:
        self._missing.clear()
        if self._deadline is not None:
            self._deadline.cancel()
        prompts, self._prompts = self._prompts, None
        if prompts is not None:
            self._codec.encode_queued(prompts)
