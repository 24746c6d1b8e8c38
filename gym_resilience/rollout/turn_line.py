"""``TurnLine``: rollouts that step their envs while the engine has none of the batch's requests send
their next prompts together.

When a batch's rollouts move in step (turns of the same length, the turn-synchronous case), a turn's
generations come back together, every env steps, and the steps end one by one: sent as each step ends,
the next prompts would reach the engine over several of its steps, their prefill split over those steps
and their generations ending at different steps, the last ones slowed by the event loop resuming the
first. So while the engine has no request of the batch in flight, a rollout ready for its next turn waits
for the others still between a generation and their next request: until each of them sent one or ended,
or ``RunnerConfig.turn_wait_s`` after the first began to wait. Once any request of the batch is in flight
the engine is busy, and a request joins its next step: nothing waits. Nor does anything wait for an engine
never seen with two of the batch's requests at once (one that answers before the event loop moves on, as
a scripted one does): it has nothing to gain from prompts sent together.
"""

from __future__ import annotations

import asyncio

__all__ = ["TurnLine"]


class TurnLine:
    """The rollouts of one batch between turns, and those waiting to send their next request (event loop
    only). ``wait_s``: the longest a rollout waits, counted from the first that waits; 0, no wait."""

    def __init__(self, wait_s: float) -> None:
        self._wait_s = wait_s
        self._in_flight = 0  # requests of the batch in the engine
        self._batching = False  # the engine was seen with two of them at once
        self._between = 0  # rollouts after a generation, before their next request or their end
        self._held: list[asyncio.Future[None]] = []
        self._deadline: asyncio.TimerHandle | None = None
        self._request = _InFlight(self)  # one for every request: nothing is made for each

    def request(self) -> _InFlight:
        """Count one engine request in flight while the block runs; the first lets every held rollout go."""
        return self._request

    def _request_sent(self) -> None:
        self._in_flight += 1
        if self._in_flight > 1:
            self._batching = True
        if self._held:
            self._release()

    def generated(self) -> None:
        """A rollout has a generation back and will send another request or end (:meth:`next_turn`,
        :meth:`left`: exactly one of them follows)."""
        self._between += 1

    async def next_turn(self) -> None:
        """Return when the rollout may send its next request: at once while a request of the batch is in
        flight, no other rollout is between turns or the engine was never seen batching; else once the
        last of those sent or ended, or the wait is over."""
        self._between -= 1
        if self._in_flight or not self._between or not self._batching or self._wait_s <= 0:
            if self._held:
                self._release()
            return
        held: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._held.append(held)
        if self._deadline is None:
            self._deadline = asyncio.get_running_loop().call_later(self._wait_s, self._release)
        await held

    def left(self) -> None:
        """A rollout between turns ended (done, failed or cancelled) without another request."""
        self._between -= 1
        if not self._between and self._held:
            self._release()

    def _release(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        held, self._held = self._held, []
        for future in held:
            if not future.done():  # its rollout was cancelled meanwhile
                future.set_result(None)


class _InFlight:
    """The block of :meth:`TurnLine.request` (it holds no state of its own: blocks may nest and overlap)."""

    __slots__ = ("_line",)

    def __init__(self, line: TurnLine) -> None:
        self._line = line

    def __enter__(self) -> None:
        self._line._request_sent()

    def __exit__(self, *exc_info: object) -> None:
        self._line._in_flight -= 1
