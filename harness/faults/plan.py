"""The fault plan: a scenario's faults and the decisions of when each one fires.

:class:`FaultPlan` decides, as a function of where a call is (rollout, attempt, turn), whether a fault
fires; every firing is appended to a JSON-lines log that threads and isolated env worker processes
share. The injectors (``harness.faults.env``, ``.engine``, ``.nodes``, ``.proxy``) ask it on every call.

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

The log is JSON lines appended with ``O_APPEND``, one ``write`` per record, so every thread and process
may append to it at once; one open/write/close per record costs microseconds, against the milliseconds
of an env or engine call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gym_resilience.errors import UnsupportedConfigError
from gym_resilience.rollout_header import RolloutIdentity
from harness.jsonlines import append_json_line, read_json_lines
from harness.scenario.kinds import KINDS, kind_of
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
    "FaultFiring",
    "FaultPlan",
    "connection_fires",
    "draw",
    "read_firings",
    "request_fires",
]


@dataclass(frozen=True, slots=True)
class FaultFiring:
    """One time a fault hit: which fault (its index in the file), where, and when in the faulted run."""

    fault: int
    kind: str
    target: str
    rollout: int | None
    attempt: int | None
    turn: int | None
    detail: str
    at_s: float
    endpoint: int | None = None
    """The served endpoint it hit (a ``kill``'s server, the endpoint behind an engine-link proxy);
    None when it hit no one endpoint."""

    @property
    def failed_call(self) -> bool:
        """Whether the call it hit failed (a delay, a latency or an abort only slow or shorten it)."""
        return KINDS[(self.target, self.kind)].fails_call


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


def _none_first(value: int | None) -> int:
    return -1 if value is None else value


def read_firings(log_path: Path) -> list[FaultFiring]:
    """Every firing logged to ``log_path`` (none if it does not exist), in a deterministic order.

    Sorted by rollout, attempt, turn, fault and detail (unknown coordinates first), then ``at_s``, so
    two runs of a scenario list the same firings in the same order whatever the scheduling.
    """
    firings = [FaultFiring(**record) for record in read_json_lines(log_path)]
    return sorted(
        firings,
        key=lambda f: (
            _none_first(f.rollout),
            _none_first(f.attempt),
            _none_first(f.turn),
            f.fault,
            f.detail,
            f.at_s,
        ),
    )


class FaultPlan:
    """A scenario's faults, the decisions of when they fire, and the log of their firings.

    Picklable, so it crosses into isolated env workers; every process appends to the same log.
    ``nth_call`` counters are per process (and start at 0 in an unpickled copy): in isolated workers,
    where each env has its own process, target with rollouts, turns or probability instead.

    Args:
        faults: The scenario's faults; a fault's index in this sequence is its identity (logs, seeds).
        seed: The scenario's seed, from which every ``probability`` draw derives.
        log_path: The JSON-lines file firings are appended to (created on the first firing).
        start: ``time.time()`` when the faulted run started; firings are logged as offsets from it.
        exceptions: The class each ``raise`` fault raises, by the fault's index, as the scenario's
            compiled form resolved it (``CompiledScenario.exceptions``); nothing is resolved again here.

    Raises:
        UnsupportedConfigError: a ``raise`` fault has no class in ``exceptions`` (``option`` names it,
            e.g. ``faults[2].exception``).

    Example:
        >>> from harness.scenario.spec import EnvFault, Targeting
        >>> plan = FaultPlan([EnvFault(target="env", kind="raise", when=Targeting(turns=[1]))],
        ...                  seed=0, log_path=Path("/dev/null"), start=time.time(),
        ...                  exceptions={0: RuntimeError})
        >>> plan.fires(0, rollout=3, attempt=0, turn=1), plan.fires(0, rollout=3, attempt=0, turn=0)
        (True, False)
    """

    def __init__(
        self,
        faults: Sequence[Fault],
        seed: int,
        log_path: Path,
        start: float,
        exceptions: Mapping[int, type[BaseException]] | None = None,
    ) -> None:
        self.faults: tuple[Fault, ...] = tuple(faults)
        self.seed = seed
        self.log_path = Path(log_path)
        self.start = start
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
        """Log that fault ``fault_index`` fired, and return the record."""
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
        self.log(firing)
        return firing

    def log(self, firing: FaultFiring) -> None:
        """Append ``firing`` to the log (for injectors that build their own record, as the proxy does)."""
        append_json_line(self.log_path, dataclasses.asdict(firing))

    def firings(self) -> list[FaultFiring]:
        """Every firing logged so far, by any process, in ``read_firings`` order."""
        return read_firings(self.log_path)
