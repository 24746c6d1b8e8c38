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
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

__all__ = ["StartLine"]


class StartLine:
    """Where the rollouts ``indices`` wait for each other before their first prompt, ``wait_s`` at most
    after the first arrives or leaves (event loop only)."""

    def __init__(self, indices: Iterable[int], wait_s: float) -> None:
        self._missing = set(indices)
        self._wait_s = wait_s
        self._open = asyncio.Event()
        self._deadline: asyncio.TimerHandle | None = None
        if len(self._missing) <= 1 or wait_s <= 0:  # nobody to wait for, or no wait
            self._release()

    async def ready(self, index: int) -> None:
        """Rollout ``index`` has its env open: wait for the others on the line, if it is one of them and
        has not left it (a retry); any other rollout goes on at once."""
        if index not in self._missing:
            return
        self.leave(index)
        await self._open.wait()

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
        self._open.set()
