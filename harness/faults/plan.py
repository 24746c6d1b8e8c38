"""The fault plan: a scenario's faults and the decisions of when each one fires.

:class:`FaultPlan` decides, as a function of where a call is (rollout, attempt, turn), whether a fault
fires, and reports each firing to the run's recorder. The injectors (``harness.faults.env``,
``.engine``, ``.nodes``, ``.proxy``) ask it on every call.

Where a call is:

- engine calls: ``gym_resilience.current_rollout()`` (rollout index, attempt, turn) inside a
  ``BatchRunner`` rollout; outside one (a user's own pipeline) the rollout, attempt and turn are
  unknown (None), so only ``nth_call`` and ``probability`` (drawn per call number) can target them;
- env calls: ``current_rollout()`` in-process; in an isolated worker process (where the context
  variable does not reach) the ``rollout_index`` and ``attempt`` that ``BatchRunner`` passes in
  ``reset``'s ``options``; else the ``rollout`` given at construction (the task's index in the batch,
  for user pipelines), attempt 0. The turn of ``step`` is the number of steps since ``reset`` (0-based),
  ``reset`` has none, and ``close`` has the turn of the last step since ``reset`` (None without one).

A filter on rollouts, turns or attempts never matches a call where that coordinate is unknown.

Every firing is reported to the run's events (``harness.faults.events.RunEvents``, the run's recorder),
from whichever thread or process it happened in.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from gym_resilience.errors import UnsupportedConfigError
from gym_resilience.rollout_header import RolloutIdentity
from harness.faults.events import FaultFiring, RunEvents
from harness.scenario.kinds import kind_of
from harness.scenario.spec import (
    ConnectionTargeting,
    EngineFault,
    EnvFault,
    Fault,
    NetworkFault,
    RayFault,
    Targeting,
)

__all__ = [
    "FaultPlan",
    "connection_fires",
    "draw",
    "request_fires",
]


def draw(seed: int, *key: object) -> float:
    """A uniform draw in [0, 1) fixed by ``seed`` and ``key``: the same on every run, in every process.

    Seeded from a BLAKE2 digest of the key's text, never from Python's ``hash()`` (salted per process).
    """
    text = ":".join(str(part) for part in (seed, *key))
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big")).random()


def connection_fires(when: ConnectionTargeting, *, seed: int, fault_index: int, connection: int) -> bool:
    """Whether a network fault hits TCP connection number ``connection`` (0-based, accept order).

    Only a fault with ``nth_connection`` is decided per connection; every other one per request.
    """
    if when.nth_connection is None or connection not in when.nth_connection:
        return False
    if when.probability is not None:
        return draw(seed, fault_index, "connection", connection) < when.probability
    return True


def request_fires(
    when: ConnectionTargeting, *, seed: int, fault_index: int, identity: RolloutIdentity | None
) -> bool:
    """Whether a network fault hits a request serving ``identity`` (None: it named no rollout).

    A request that names no rollout is hit only by a fault with no rollout filter and no probability.
    """
    if when.nth_connection is not None:
        return False
    if identity is None or identity == RolloutIdentity():
        return not when.by_request_identity and when.probability is None
    for wanted, value in (
        (when.rollouts, identity.rollout),
        (when.turns, identity.turn),
        (when.attempts, identity.attempt),
    ):
        if wanted is not None and value not in wanted:
            return False
    if when.probability is not None:
        key = (identity.rollout, identity.attempt, identity.turn)
        return draw(seed, fault_index, "request", *key) < when.probability
    return True


class FaultPlan:
    """A scenario's faults, the decisions of when they fire, and where their firings are reported.

    Picklable, so it crosses into isolated env workers, whose firings reach the same recorder.
    ``nth_call`` counters are per process (and start at 0 in an unpickled copy): in isolated workers,
    where each env has its own process, target with rollouts, turns or probability instead.

    Args:
        faults: The scenario's faults; a fault's index in this sequence is its identity (logs, seeds).
        seed: The scenario's seed, from which every ``probability`` draw derives.
        events: Where firings are reported (the run's recorder); their times are offsets from its
            ``start``. None reports none (the plan then only decides).
        exceptions: The class each ``raise`` fault raises, by the fault's index, as the scenario's
            compiled form resolved it (``CompiledScenario.exceptions``); nothing is resolved again here.

    Raises:
        UnsupportedConfigError: a ``raise`` fault has no class in ``exceptions`` (``option`` names it,
            e.g. ``faults[2].exception``).

    Example:
        >>> from harness.scenario.spec import EnvFault, Targeting
        >>> plan = FaultPlan([EnvFault(target="env", kind="raise", when=Targeting(turns=[1]))],
        ...                  seed=0, exceptions={0: RuntimeError})
        >>> plan.fires(0, rollout=3, attempt=0, turn=1), plan.fires(0, rollout=3, attempt=0, turn=0)
        (True, False)
    """

    def __init__(
        self,
        faults: Sequence[Fault],
        seed: int,
        events: RunEvents | None = None,
        exceptions: Mapping[int, type[BaseException]] | None = None,
    ) -> None:
        self.faults: tuple[Fault, ...] = tuple(faults)
        self.seed = seed
        self.events = events
        self.start = events.start if events is not None else time.time()
        self._exceptions = dict(exceptions or {})
        self._calls: dict[int, int] = {}
        self._lock = threading.Lock()
        for index, fault in enumerate(self.faults):
            if kind_of(fault).raises and index not in self._exceptions:
                raise UnsupportedConfigError(
                    f"no exception class for the raise fault {getattr(fault, 'exception', '')!r}: give the "
                    "classes the "
                    "scenario was compiled with (CompiledScenario.exceptions)",
                    option=f"faults[{index}].exception",
                )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        state["_calls"] = {}  # nth_call counts are per process: see the class docstring
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def env_faults(self, method: str) -> list[tuple[int, EnvFault]]:
        """The env faults on ``method``, with their indices."""
        return [(i, f) for i, f in enumerate(self.faults) if isinstance(f, EnvFault) and f.method == method]

    def engine_faults(self) -> list[tuple[int, EngineFault]]:
        """The engine faults, with their indices."""
        return [(i, f) for i, f in enumerate(self.faults) if isinstance(f, EngineFault)]

    def ray_faults(self, kind: str) -> list[tuple[int, RayFault]]:
        """The ray faults of ``kind`` (``kill_actor`` or ``kill_node``), with their indices."""
        return [(i, f) for i, f in enumerate(self.faults) if isinstance(f, RayFault) and f.kind == kind]

    def network_faults(self, link: str) -> list[tuple[int, NetworkFault]]:
        """The network faults on ``link`` (``engine`` or ``tool``), with their indices, for a FaultProxy."""
        return [(i, f) for i, f in enumerate(self.faults) if isinstance(f, NetworkFault) and f.link == link]

    def fires(
        self,
        fault_index: int,
        *,
        rollout: int | None,
        attempt: int | None,
        turn: int | None,
        call: int | None = None,
    ) -> bool:
        """Whether env, engine or kill_actor fault ``fault_index`` hits a call at (rollout, attempt, turn).

        Every given filter of the fault's ``Targeting`` must match. ``probability`` draws from
        (seed, fault index, rollout, attempt, turn, ``call``), where ``call`` distinguishes calls whose
        coordinates are unknown (an engine call outside a rollout passes its call number). ``nth_call``
        counts last, among calls that passed every other filter, so this call changes the count.
        """
        fault = self.faults[fault_index]
        if isinstance(fault, NetworkFault):
            raise TypeError(f"fault {fault_index} is a network fault: decide with connection_fires")
        if not kind_of(fault).per_call:
            raise TypeError(f"fault {fault_index} is a {fault.kind} fault: NodeKiller decides it")
        when: Targeting = fault.when
        if when.rollouts is not None and rollout not in when.rollouts:
            return False
        if when.turns is not None and turn not in when.turns:
            return False
        if when.attempts is not None and attempt not in when.attempts:
            return False
        if when.probability is not None and (
            draw(self.seed, fault_index, rollout, attempt, turn, call) >= when.probability
        ):
            return False
        if when.nth_call is not None:
            with self._lock:
                number = self._calls.get(fault_index, 0)
                self._calls[fault_index] = number + 1
            return number in when.nth_call
        return True

    def exception(self, fault_index: int) -> BaseException:
        """A fresh instance of the exception a ``raise`` fault raises, marked as injected in a note."""
        fault = self.faults[fault_index]
        if not isinstance(fault, EnvFault | EngineFault) or not kind_of(fault).raises:
            raise TypeError(f"fault {fault_index} is not a raise fault")
        error = self._exceptions[fault_index](fault.message)
        error.add_note(f"injected by chaos fault {fault_index}")
        return error

    def record(
        self, fault_index: int, *, rollout: int | None, attempt: int | None, turn: int | None, detail: str
    ) -> FaultFiring:
        """Report that fault ``fault_index`` fired, and return the record."""
        fault = self.faults[fault_index]
        firing = FaultFiring(
            fault=fault_index,
            kind=fault.kind,
            target=fault.target,
            rollout=rollout,
            attempt=attempt,
            turn=turn,
            detail=detail,
            at_s=time.time() - self.start,
        )
        self.report(firing)
        return firing

    def report(self, firing: FaultFiring) -> None:
        """Report ``firing`` (for injectors that build their own record, as the proxy does)."""
        if self.events is not None:
            self.events.fired(firing)
