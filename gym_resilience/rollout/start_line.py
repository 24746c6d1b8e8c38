"""``StartLine``: the rollouts a batch starts at once send their first prompts to the engine together.

Envs open in pool threads and come back to the event loop in waves, as threads finish. A rollout that
went on at once would encode its prompt and send it while its siblings' envs are still opening; the
later waves then wait on the event loop behind the engine's work for the first (adding its requests,
handling its first outputs). A 64-rollout batch's last request then reached vLLM up to 20 ms later
than when every env came back at once, and its generation ended as much later, and the batch with it.

So the first rollouts wait at a start line, once their env is open and reset, for the siblings still
opening theirs; ``START_WAIT_S`` at most after the first got there, so one slow or stuck reset holds up
the others that long at worst. Rollouts started later (as slots free up under ``max_concurrency``) and
retries do not wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

__all__ = ["START_WAIT_S", "StartLine"]

START_WAIT_S = 0.01
"""How long the first rollout at the start line waits for the others, at most."""


class StartLine:
    """Where the rollouts ``indices`` wait for each other before their first prompt (event loop only)."""

    def __init__(self, indices: Iterable[int], wait_s: float | None = None) -> None:
        self._missing = set(indices)
        self._wait_s = START_WAIT_S if wait_s is None else wait_s
        self._open = asyncio.Event()
        self._deadline: asyncio.TimerHandle | None = None
        if len(self._missing) <= 1:  # nobody to wait for
            self._release()

    async def ready(self, index: int) -> None:
        """Rollout ``index`` has its env open: wait for the others (any other rollout goes on at once)."""
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
