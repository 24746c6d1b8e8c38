"""The engine wrapper: injects a plan's engine faults into ``generate``, and logs a span per call."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from gym_resilience import current_rollout
from gym_resilience.engines.base import Engine, Generation, Sampling, Tokenizer
from gym_resilience.errors import UnsupportedConfigError
from harness.faults.plan import FaultPlan
from harness.faults.spans import SpanLog
from harness.scenario.spec import EngineFault

__all__ = ["FaultyEngine"]


class FaultyEngine:
    """An ``Engine`` that injects a plan's engine faults into ``generate``, and logs a span per call.

    Fault kinds: ``raise`` (before generating), ``delay`` (``asyncio.sleep``, then generate; inside the
    runner's generation deadline), ``abort`` (generate, then keep the first half of the tokens, at least
    one, with finish reason ``abort`` and logprobs trimmed to match), ``kill`` (once per fault: when the
    request numbered ``after_requests`` (0-based, counting every request) or a later one that passes
    the fault's targeting starts, call ``kill(server)``, then send the request anyway, to the dying
    server). Delays and kills apply first, then a raise; an abort applies to the generation.

    Every other attribute (``start``, ``close``, ``stats``, ...) is the inner engine's, and
    ``async with`` enters and exits the inner engine.

    Args:
        engine: The engine to wrap.
        plan: The faults; None injects nothing (the wrapper then only records spans).
        spans: Where to log each call's span; None logs none.
        kill: ``kill(server_index)`` SIGKILLs a served engine's process; required by a ``kill`` fault.

    Raises:
        UnsupportedConfigError: the plan has a ``kill`` fault and no ``kill`` callback was given.
    """

    def __init__(
        self,
        engine: Engine,
        plan: FaultPlan | None = None,
        *,
        spans: SpanLog | None = None,
        kill: Callable[[int], object] | None = None,
    ) -> None:
        self.engine = engine
        self.plan = plan
        self.spans = spans
        self._kill = kill
        self._faults = plan.engine_faults() if plan is not None else []
        if kill is None and any(f.kind == "kill" for _, f in self._faults):
            index = next(i for i, f in self._faults if f.kind == "kill")
            raise UnsupportedConfigError(
                "a kill fault needs served engine processes to kill: FaultyEngine got no kill callback",
                option=f"faults[{index}].kind",
            )
        self._lock = threading.Lock()
        self._requests = 0
        self._killed: set[int] = set()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def requests(self) -> int:
        """How many ``generate`` calls were made so far."""
        return self._requests

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not found normally: everything else is the inner engine's.
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    async def __aenter__(self) -> FaultyEngine:
        await self.engine.__aenter__()  # type: ignore[attr-defined]
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> object:
        return await self.engine.__aexit__(exc_type, exc, tb)  # type: ignore[attr-defined]

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        """Generate through the inner engine, with whatever engine faults fire on this call."""
        with self._lock:
            call, self._requests = self._requests, self._requests + 1
        progress = current_rollout()
        rollout: int | None = None
        attempt: int | None = None
        turn: int | None = None
        if progress is not None:
            rollout, attempt, turn = progress.rollout_index, progress.attempt, progress.turn
        if self.spans is None:
            return await self._generate(prompt_ids, sampling, call, rollout, attempt, turn)
        with self.spans.span("generate", rollout=rollout, attempt=attempt, turn=turn):
            return await self._generate(prompt_ids, sampling, call, rollout, attempt, turn)

    def _decide(
        self, call: int, rollout: int | None, attempt: int | None, turn: int | None
    ) -> list[tuple[int, EngineFault]]:
        """The faults that fire on request number ``call``: pure but for nth_call counts and kill-once."""
        plan = self.plan
        if plan is None:
            return []
        # Inside a rollout its coordinates key the probability draw, and the request's number (which
        # depends on scheduling) must not; outside one the number is all there is.
        where = {
            "rollout": rollout,
            "attempt": attempt,
            "turn": turn,
            "call": call if rollout is None else None,
        }
        fired: list[tuple[int, EngineFault]] = []
        for index, fault in self._faults:
            if fault.kind == "kill":
                with self._lock:
                    if index in self._killed or call < fault.after_requests:
                        continue
                    if not plan.fires(index, **where):
                        continue
                    self._killed.add(index)
            elif not plan.fires(index, **where):
                continue
            fired.append((index, fault))
        return fired

    async def _generate(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        call: int,
        rollout: int | None,
        attempt: int | None,
        turn: int | None,
    ) -> Generation:
        fired = self._decide(call, rollout, attempt, turn)
        plan = self.plan
        if plan is None or not fired:
            return await self.engine.generate(prompt_ids, sampling)
        where = {"rollout": rollout, "attempt": attempt, "turn": turn}
        for index, fault in fired:
            if fault.kind == "delay":
                plan.record(index, **where, detail=f"generate delayed {fault.delay_s:g} s")
                await asyncio.sleep(fault.delay_s)
            elif fault.kind == "kill" and self._kill is not None:
                plan.record(index, **where, detail=f"killed server {fault.server} at request {call}")
                self._kill(fault.server)
        raising = next((i for i, f in fired if f.kind == "raise"), None)
        if raising is not None:
            error = plan.exception(raising)
            plan.record(raising, **where, detail=f"generate raised {type(error).__name__}: {error}")
            raise error
        generation = await self.engine.generate(prompt_ids, sampling)
        aborting = next((i for i, f in fired if f.kind == "abort"), None)
        if aborting is None:
            return generation
        aborted = _aborted(generation)
        plan.record(
            aborting,
            **where,
            detail=f"generate aborted after {len(aborted.token_ids)} of {len(generation.token_ids)} tokens",
        )
        return aborted


def _aborted(generation: Generation) -> Generation:
    """The generation cut to its first half (at least one token, if it had any), finish reason abort."""
    total = len(generation.token_ids)
    keep = min(total, max(1, total // 2))
    logprobs = None if generation.logprobs is None else list(generation.logprobs[:keep])
    return Generation(token_ids=list(generation.token_ids[:keep]), logprobs=logprobs, finish_reason="abort")
