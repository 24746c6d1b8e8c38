"""The engine wrapper: injects a plan's engine faults into ``generate``, and logs a span per call."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

from gym_resilience import current_rollout
from gym_resilience.engines.base import Engine, Generation, Sampling, Tokenizer
from gym_resilience.errors import UnsupportedConfigError
from harness.faults.events import RunEvents, timed_call
from harness.faults.injectors import Injector, check_table
from harness.faults.plan import FaultPlan
from harness.scenario.spec import EngineFault

__all__ = ["ENGINE_INJECTORS", "FaultyEngine"]


class FaultyEngine:
    """An ``Engine`` that injects a plan's engine faults into ``generate``, and reports a span per call.

    Fault kinds: ``raise`` (before generating), ``delay`` (``asyncio.sleep``, then generate; inside the
    runner's generation deadline), ``abort`` (generate, then keep the first half of the tokens, at least
    one, with finish reason ``abort`` and logprobs trimmed to match), ``kill`` (once per fault: when the
    request numbered ``after_requests`` (0-based, counting every request) or a later one that passes
    the fault's targeting starts, call ``kill(server)``, then send the request anyway, to the dying
    server). Each kind is one entry of :data:`ENGINE_INJECTORS`: delays and kills apply first, then a
    raise; an abort applies to the generation.

    Every other attribute (``start``, ``close``, ``stats``, ...) is the inner engine's, and
    ``async with`` enters and exits the inner engine.

    Args:
        engine: The engine to wrap.
        plan: The faults; None injects nothing (the wrapper then only reports spans).
        events: Where each call's span is reported (the run's recorder); None reports none.
        kill: ``kill(server_index)`` SIGKILLs a served engine's process; required by a ``kill`` fault.

    Raises:
        UnsupportedConfigError: the plan has a ``kill`` fault and no ``kill`` callback was given.
    """

    def __init__(
        self,
        engine: Engine,
        plan: FaultPlan | None = None,
        *,
        events: RunEvents | None = None,
        kill: Callable[[int], object] | None = None,
    ) -> None:
        self.engine = engine
        self.plan = plan
        self.events = events
        self.kill = kill
        self._faults = plan.engine_faults() if plan is not None else []
        # Only a kill fault needs the callback: one decision about one kind, so no table entry.
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
        if name in ("engine", "kill"):
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
        with timed_call(self.events, "generate", rollout=rollout, attempt=attempt, turn=turn):
            return await self._generate(EngineCall(self, call, rollout, attempt, turn), prompt_ids, sampling)

    def _decide(self, call: EngineCall) -> list[tuple[int, EngineFault]]:
        """The faults that fire on ``call``: pure but for nth_call counts and gates (a kill fires once)."""
        plan = self.plan
        if plan is None:
            return []
        # Inside a rollout its coordinates key the probability draw, and the request's number (which
        # depends on scheduling) must not; outside one the number is all there is.
        where = {
            "rollout": call.rollout,
            "attempt": call.attempt,
            "turn": call.turn,
            "call": call.number if call.rollout is None else None,
        }
        fired: list[tuple[int, EngineFault]] = []
        for index, fault in self._faults:
            gate = ENGINE_INJECTORS[fault.kind].gate
            if gate is None:
                if plan.fires(index, **where):
                    fired.append((index, fault))
                continue
            with self._lock:  # gate and decision at once: two requests never both pass a once-only gate
                if gate(call, index, fault) and plan.fires(index, **where):
                    self._killed.add(index)
                    fired.append((index, fault))
        return fired

    async def _generate(self, call: EngineCall, prompt_ids: list[int], sampling: Sampling) -> Generation:
        fired = self._decide(call)
        if not fired:
            return await self.engine.generate(prompt_ids, sampling)
        for index, fault in fired:
            if ENGINE_INJECTORS[fault.kind].phase == "before":
                await ENGINE_INJECTORS[fault.kind].apply(call, index, fault)
        phased = {
            phase: next(((i, f) for i, f in fired if ENGINE_INJECTORS[f.kind].phase == phase), None)
            for phase in ("instead", "after")
        }
        if (instead := phased["instead"]) is not None:
            generation: Generation = await ENGINE_INJECTORS[instead[1].kind].apply(call, *instead)
            return generation
        call.generation = await self.engine.generate(prompt_ids, sampling)
        if (after := phased["after"]) is not None:
            return await ENGINE_INJECTORS[after[1].kind].apply(call, *after)  # type: ignore[no-any-return]
        return call.generation


@dataclass
class EngineCall:
    """One ``generate`` call: its number among every request, where it is, and, once the inner engine
    answered, its generation (what an ``after`` kind changes)."""

    engine: FaultyEngine
    number: int
    rollout: int | None
    attempt: int | None
    turn: int | None
    generation: Generation | None = None

    def fired(self, index: int, detail: str) -> None:
        if self.engine.plan is not None:
            where = {"rollout": self.rollout, "attempt": self.attempt, "turn": self.turn}
            self.engine.plan.record(index, **where, detail=detail)


async def _delay(call: EngineCall, index: int, fault: EngineFault) -> None:
    call.fired(index, f"generate delayed {fault.delay_s:g} s")
    await asyncio.sleep(fault.delay_s)


def _kill_gate(call: EngineCall, index: int, fault: EngineFault) -> bool:
    """A kill fires once, on request ``after_requests`` or a later one (the caller holds the lock)."""
    return index not in call.engine._killed and call.number >= fault.after_requests


async def _kill(call: EngineCall, index: int, fault: EngineFault) -> None:
    if call.engine.kill is not None:
        call.fired(index, f"killed server {fault.server} at request {call.number}")
        call.engine.kill(fault.server)


async def _raise(call: EngineCall, index: int, fault: EngineFault) -> Generation:
    assert call.engine.plan is not None  # a fault fired: there is a plan
    error = call.engine.plan.exception(index)
    call.fired(index, f"generate raised {type(error).__name__}: {error}")
    raise error


async def _abort(call: EngineCall, index: int, fault: EngineFault) -> Generation:
    generation = call.generation
    assert generation is not None  # an after kind runs on the inner engine's answer
    aborted = _aborted(generation)
    call.fired(
        index, f"generate aborted after {len(aborted.token_ids)} of {len(generation.token_ids)} tokens"
    )
    return aborted


ENGINE_INJECTORS: Final[Mapping[str, Injector[EngineCall]]] = {
    "delay": Injector("before", _delay),
    "kill": Injector("before", _kill, gate=_kill_gate),
    "raise": Injector("instead", _raise),
    "abort": Injector("after", _abort),
}
"""What each engine fault kind does to the ``generate`` call it hits."""
check_table("engine", ENGINE_INJECTORS)


def _aborted(generation: Generation) -> Generation:
    """The generation cut to its first half (at least one token, if it had any), finish reason abort."""
    total = len(generation.token_ids)
    keep = min(total, max(1, total // 2))
    logprobs = None if generation.logprobs is None else list(generation.logprobs[:keep])
    return Generation(token_ids=list(generation.token_ids[:keep]), logprobs=logprobs, finish_reason="abort")
