"""Fault injection for chaos scenarios: the plan that decides, the wrappers that inject.

:class:`FaultPlan` holds a scenario's faults and decides, as a function of where a call is (rollout,
attempt, turn), whether a fault fires; every firing is appended to a JSON-lines log that threads and
isolated env worker processes share. :class:`FaultyEnv` (a Gymnasium wrapper) and :class:`FaultyEngine`
(an ``Engine`` wrapper) ask the plan on every call and inject what fired. Both also record a span per
call into a :class:`SpanLog`, from which :func:`build_rollout_spans` draws the timeline of each rollout.

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

Both logs are JSON lines appended with ``O_APPEND``, one ``write`` per record, so every thread and
process may append to them at once; one open/write/close per record costs microseconds, against the
milliseconds of an env or engine call.

Ray faults (``target: ray``): a ``kill_actor`` is injected by :class:`FaultyEnv`, which runs inside the
env's Ray actor and SIGKILLs its own worker process mid-step, so the driver sees the actor die during the
call; a ``kill_node`` by :class:`NodeKiller`, a thread of the harness process that watches the span log
and removes a worker node of the scenario's cluster. Inside an actor every ``reset`` span also logs the
actor's node, which is how :class:`NodeKiller` sees, while the batch runs, which node hosts which envs
(the probes read the runner's attempt records instead, which also know the node of an attempt that
never got to ``reset``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal, Protocol, SupportsFloat, TypeVar

import gymnasium

from gym_resilience import current_rollout
from gym_resilience.engines.base import Engine, Generation, Sampling, Tokenizer
from gym_resilience.errors import UnsupportedConfigError
from gym_resilience.rollout_header import RolloutIdentity
from gym_resilience.tasks import Task
from harness.jsonlines import append_json_line, read_json_lines
from harness.results import FaultFiring, RolloutSpan, TurnSpan
from harness.spec import (
    ConnectionTargeting,
    EngineFault,
    EnvFault,
    Fault,
    NetworkFault,
    RayFault,
    Targeting,
)

__all__ = [
    "BAD_RESET_OBSERVATION",
    "BAD_REWARD",
    "BAD_STEP_OBSERVATION",
    "HANG_S",
    "FaultPlan",
    "FaultyEngine",
    "FaultyEnv",
    "FaultyEnvFactory",
    "NodeKiller",
    "Span",
    "SpanKind",
    "SpanLog",
    "build_rollout_spans",
    "connection_fires",
    "draw",
    "ray_placement",
    "read_firings",
]

HANG_S: Final = 24 * 3600.0
"""How long a ``hang`` sleeps: past any deadline. Only an isolated env (a process to kill) survives it."""

BAD_RESET_OBSERVATION: Final = 12345
"""What a ``bad_output`` reset returns as its observation: an int, not chat messages."""
BAD_STEP_OBSERVATION: Final = {"text": "not a chat message"}
"""What a ``bad_output`` step returns as its observation: a dict with no ``role`` and no ``content``."""
BAD_REWARD: Final = "lots"
"""What a ``bad_output`` step returns as its reward: a string that ``float()`` rejects."""

SpanKind = Literal["generate", "reset", "step", "close"]
T = TypeVar("T")


# --- Decisions. ---------------------------------------------------------------------------------------


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
        >>> from harness.spec import EnvFault, Targeting
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
            if (
                not isinstance(fault, NetworkFault)
                and fault.kind == "raise"
                and index not in self._exceptions
            ):
                raise UnsupportedConfigError(
                    f"no exception class for the raise fault {fault.exception!r}: give the classes the "
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
        if isinstance(fault, RayFault) and fault.kind == "kill_node":
            raise TypeError(f"fault {fault_index} is a kill_node fault: NodeKiller decides it")
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
        if not isinstance(fault, EnvFault | EngineFault) or fault.kind != "raise":
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


# --- Spans: the timeline of each rollout. ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Span:
    """One env or engine call as logged: offsets from the run's start; ``end_s`` None if it never ended."""

    kind: SpanKind
    rollout: int | None
    attempt: int | None
    turn: int | None
    start_s: float
    end_s: float | None
    failed: bool
    node: str | None = None
    """The Ray node the call ran on (logged by ``reset`` in a Ray actor); None elsewhere."""


class SpanLog:
    """The calls of a faulted run, appended as JSON lines to ``path``.

    A file rather than an in-memory list, so env calls in isolated worker processes land in the same
    timeline as in-process ones; it is picklable for the same reason. A call that never returns (a
    ``hang``) is logged when it starts, with no end.
    """

    def __init__(self, path: Path, start: float) -> None:
        self.path = Path(path)
        self.start = start

    def record(
        self,
        kind: SpanKind,
        *,
        rollout: int | None,
        attempt: int | None,
        turn: int | None,
        started: float,
        ended: float | None,
        failed: bool,
        node: str | None = None,
    ) -> None:
        """Log one call; ``started`` and ``ended`` are ``time.time()`` values."""
        span = Span(
            kind=kind,
            rollout=rollout,
            attempt=attempt,
            turn=turn,
            start_s=started - self.start,
            end_s=None if ended is None else ended - self.start,
            failed=failed,
            node=node,
        )
        append_json_line(self.path, dataclasses.asdict(span))

    @contextmanager
    def span(
        self,
        kind: SpanKind,
        *,
        rollout: int | None,
        attempt: int | None,
        turn: int | None,
        node: str | None = None,
    ) -> Iterator[None]:
        """Log the enclosed call, failed if anything (``KeyboardInterrupt`` included) escapes it."""
        started = time.time()
        failed = True
        try:
            yield
            failed = False
        finally:
            ended = time.time()
            where = {"rollout": rollout, "attempt": attempt, "turn": turn}
            self.record(kind, **where, started=started, ended=ended, failed=failed, node=node)

    def read(self) -> list[Span]:
        """Every span logged so far, by any process, in order of start."""
        spans = [Span(**record) for record in read_json_lines(self.path)]
        return sorted(spans, key=lambda s: (s.start_s, _none_first(s.rollout), _none_first(s.turn), s.kind))


def build_rollout_spans(
    span_log: SpanLog | Sequence[Span], n_rollouts: int, *, until_s: float | None = None
) -> list[RolloutSpan]:
    """One ``RolloutSpan`` per rollout index ``0 .. n_rollouts - 1``, its calls by attempt, then start.

    ``span_log`` is the log, or the spans already read from it (``SpanLog.read()``).

    Calls outside any known rollout (an engine call in a user's pipeline) are left out. A call that
    never ended (a hang, whose worker a deadline killed) counts as failed and ends where its rollout's
    next call starts (a retry), else at ``until_s``, else at the last moment anything was logged: the
    kill itself is not logged, so this is an upper bound. ``placeholder`` and ``error`` are left for
    the caller, who knows the batch's failures.
    """
    spans = span_log.read() if isinstance(span_log, SpanLog) else list(span_log)
    last = max((s.end_s if s.end_s is not None else s.start_s for s in spans), default=0.0)
    open_end = until_s if until_s is not None else last
    by_rollout: list[list[Span]] = [[] for _ in range(n_rollouts)]
    for span in spans:
        if span.rollout is not None and 0 <= span.rollout < n_rollouts:
            by_rollout[span.rollout].append(span)
    rollouts = []
    for index, calls in enumerate(by_rollout):
        calls.sort(key=lambda s: (_none_first(s.attempt), s.start_s))
        turn_spans = []
        for position, span in enumerate(calls):
            end_s = span.end_s
            if end_s is None:
                later = [s.start_s for s in calls[position + 1 :] if s.start_s >= span.start_s]
                end_s = min(later) if later else max(open_end, span.start_s)
            turn_spans.append(
                TurnSpan(
                    kind=span.kind,
                    turn=span.turn,
                    attempt=span.attempt or 0,
                    start_s=span.start_s,
                    end_s=end_s,
                    failed=span.failed or span.end_s is None,
                )
            )
        rollouts.append(RolloutSpan(index=index, spans=turn_spans))
    return rollouts


# --- The env wrapper. -----------------------------------------------------------------------------------


def ray_placement() -> tuple[str, str] | None:
    """(actor id, node id) of the Ray actor the calling code runs in; None outside one.

    Ray is only asked when something imported it already: a process that never used Ray is in no actor.
    """
    if "ray" not in sys.modules:
        return None
    import ray

    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    actor: str | None = context.get_actor_id()
    return None if actor is None else (actor, context.get_node_id())


class FaultyEnv(gymnasium.Wrapper[Any, Any, Any, Any]):
    """Injects a plan's env faults into ``reset``, ``step`` and ``close``, and logs a span per call.

    Fault kinds: ``raise`` (the named exception, built from the message), ``delay`` (sleep, then the
    real call), ``hang`` (sleep :data:`HANG_S`: only an isolated env, whose worker a deadline kills,
    gets past it), ``interrupt`` (``KeyboardInterrupt``), ``bad_output`` (the real call, whose result is
    then replaced: ``reset`` returns :data:`BAD_RESET_OBSERVATION`; ``step`` returns
    :data:`BAD_STEP_OBSERVATION` and :data:`BAD_REWARD`). Delays apply first; then the first other
    fault that fired, in scenario order, applies alone. On ``close`` the inner env is closed whatever
    the fault (but a hang), so an injected close failure leaks nothing. A ``kill_actor`` ray fault that
    fires on a ``step`` applies before all of them: the env's Ray actor SIGKILLs its own worker process.
    Where each call is (rollout, attempt, turn): see the module docstring.

    Args:
        env: The env to inject into.
        plan: The faults; None injects nothing (the wrapper then only records spans).
        spans: Where to log each call's span; None logs none.
        rollout: The rollout index to use when neither ``current_rollout()`` nor ``reset``'s options
            say (a user pipeline outside ``BatchRunner``: the task's index in the batch).
        sleep: How ``delay`` and ``hang`` sleep (tests inject a fake; it must pickle for isolated envs).

    Example:
        >>> from gym_resilience.task_gen import word_game_factory, generate_tasks
        >>> from harness.spec import EnvFault
        >>> task = generate_tasks(1, seed=0)[0]
        >>> plan = FaultPlan([EnvFault(target="env", kind="raise", exception="ConnectionResetError")],
        ...                  seed=0, log_path=Path("/dev/null"), start=time.time(),
        ...                  exceptions={0: ConnectionResetError})
        >>> env = FaultyEnv(word_game_factory(task), plan, rollout=0)
        >>> _ = env.reset(options={"task": task})
        >>> env.step("e")
        Traceback (most recent call last):
        ...
        ConnectionResetError: injected fault
        injected by chaos fault 0
    """

    def __init__(
        self,
        env: gymnasium.Env[Any, Any],
        plan: FaultPlan | None = None,
        *,
        spans: SpanLog | None = None,
        rollout: int | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(env)
        self.plan = plan
        self.spans = spans
        self.fallback_rollout = rollout
        self._sleep = sleep
        self._from_options: tuple[int, int] | None = None
        self._steps = 0
        self._faults: dict[str, list[tuple[int, EnvFault]]] = {
            method: plan.env_faults(method) if plan is not None else []
            for method in ("reset", "step", "close")
        }
        self._kills = plan.ray_faults("kill_actor") if plan is not None else []

    def _identity(self) -> tuple[int | None, int | None]:
        progress = current_rollout()
        if progress is not None:
            return progress.rollout_index, progress.attempt
        if self._from_options is not None:
            return self._from_options
        return self.fallback_rollout, None if self.fallback_rollout is None else 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset the inner env, unless a reset fault preempts it."""
        index, attempt = (options or {}).get("rollout_index"), (options or {}).get("attempt", 0)
        if isinstance(index, int) and isinstance(attempt, int):
            self._from_options = (index, attempt)
        self._steps = 0
        rollout, attempt_now = self._identity()
        placement = ray_placement()
        node = placement[1] if placement is not None else None
        with self._span("reset", rollout, attempt_now, None, node):
            return self._call(
                "reset", rollout, attempt_now, None, lambda: self.env.reset(seed=seed, options=options)
            )

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        """Step the inner env, unless a step fault preempts it; the turn is the steps since reset."""
        turn, self._steps = self._steps, self._steps + 1
        rollout, attempt = self._identity()
        with self._span("step", rollout, attempt, turn):
            self._kill_actor(rollout, attempt, turn)
            return self._call("step", rollout, attempt, turn, lambda: self.env.step(action))

    def close(self) -> None:
        """Close the inner env; a close fault applies first, but the inner env is closed regardless."""
        turn = self._steps - 1 if self._steps else None
        rollout, attempt = self._identity()
        with self._span("close", rollout, attempt, turn):
            try:
                self._call("close", rollout, attempt, turn, lambda: None)
            finally:
                self.env.close()

    @contextmanager
    def _span(
        self,
        kind: SpanKind,
        rollout: int | None,
        attempt: int | None,
        turn: int | None,
        node: str | None = None,
    ) -> Iterator[None]:
        if self.spans is None:
            yield
        else:
            with self.spans.span(kind, rollout=rollout, attempt=attempt, turn=turn, node=node):
                yield

    def _kill_actor(self, rollout: int | None, attempt: int | None, turn: int | None) -> None:
        """SIGKILL this env's Ray actor, mid-step, if a ``kill_actor`` fault fires on this step."""
        plan = self.plan
        if plan is None:
            return
        where = {"rollout": rollout, "attempt": attempt, "turn": turn}
        fired = next((i for i, _ in self._kills if plan.fires(i, **where)), None)
        if fired is None:
            return
        placement = ray_placement()
        if placement is None:
            raise UnsupportedConfigError(
                "a kill_actor fault needs the env in a Ray actor (runner.env_backend: ray); this env runs "
                "outside one",
                option=f"faults[{fired}].kind",
            )
        actor, node = placement
        plan.record(fired, **where, detail=f"step killed env actor {actor[:12]} on node {node[:12]}")
        if self.spans is not None:
            # The kill ends this process before the step's span is logged: log it now, with no end.
            now = time.time()
            self.spans.record(
                "step", rollout=rollout, attempt=attempt, turn=turn, started=now, ended=None, failed=True
            )
        # SIGKILL, not ray.kill: the process is gone before this step can return, whatever Ray does next.
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(HANG_S)  # never reached: SIGKILL is not caught; the step must not return meanwhile

    def _call(
        self,
        method: SpanKind,
        rollout: int | None,
        attempt: int | None,
        turn: int | None,
        real: Callable[[], T],
    ) -> T:
        plan = self.plan
        faults = self._faults[method]
        if plan is None or not faults:
            return real()
        fired = [(i, f) for i, f in faults if plan.fires(i, rollout=rollout, attempt=attempt, turn=turn)]
        where = {"rollout": rollout, "attempt": attempt, "turn": turn}
        for index, fault in fired:
            if fault.kind == "delay":
                plan.record(index, **where, detail=f"{method} delayed {fault.delay_s:g} s")
                self._sleep(fault.delay_s)
        effect = next(((i, f) for i, f in fired if f.kind != "delay"), None)
        if effect is None:
            return real()
        index, fault = effect
        if fault.kind == "raise":
            error = plan.exception(index)
            plan.record(index, **where, detail=f"{method} raised {type(error).__name__}: {error}")
            raise error
        if fault.kind == "interrupt":
            plan.record(index, **where, detail=f"{method} interrupted")
            raise KeyboardInterrupt(fault.message)
        if fault.kind == "hang":
            plan.record(index, **where, detail=f"{method} hung")
            if self.spans is not None:
                now = time.time()
                self.spans.record(
                    method, rollout=rollout, attempt=attempt, turn=turn, started=now, ended=None, failed=True
                )
            self._sleep(HANG_S)
            return real()
        # bad_output: the env did its work, and its answer is garbage.
        result = real()
        plan.record(index, **where, detail=f"{method} returned bad output")
        bad: T = _bad_output(method, result)
        return bad


def _bad_output(method: str, result: Any) -> Any:
    if method == "reset":
        _, info = result
        return BAD_RESET_OBSERVATION, info
    _, _, terminated, truncated, info = result
    return dict(BAD_STEP_OBSERVATION), BAD_REWARD, terminated, truncated, info


@dataclass(frozen=True)
class FaultyEnvFactory:
    """An env factory that wraps each env of ``base_factory`` in a :class:`FaultyEnv`.

    Picklable when ``base_factory`` is, so isolated envs (built in worker processes) work.
    ``index_of`` maps a task's ``instance_id`` to its index in the batch: the fallback rollout index
    when the env cannot learn it otherwise (a user pipeline outside ``BatchRunner``).
    """

    base_factory: Callable[[Task], gymnasium.Env[Any, Any]]
    plan: FaultPlan | None
    index_of: Mapping[str, int] = dataclasses.field(default_factory=dict)
    spans: SpanLog | None = None
    sleep: Callable[[float], None] = time.sleep

    def __call__(self, task: Task) -> FaultyEnv:
        return FaultyEnv(
            self.base_factory(task),
            self.plan,
            spans=self.spans,
            rollout=self.index_of.get(task.instance_id),
            sleep=self.sleep,
        )


# --- The node killer. ----------------------------------------------------------------------------------


class Cluster(Protocol):
    """What :class:`NodeKiller` needs of a local Ray cluster (``harness.cluster.LocalCluster``)."""

    def worker_node_ids(self) -> list[str]: ...

    def remove_node(self, node_id: str) -> None: ...


class NodeKiller:
    """Injects a plan's ``kill_node`` faults: a thread that watches the span log and, once a fault's
    ``after_steps`` env steps have ended, removes one worker node of ``cluster``.

    The node is the fault's ``node`` (an index into ``cluster.worker_node_ids()`` as it was when the
    killer started), else the node hosting the most env actors: attempts whose ``reset`` logged that node
    and whose ``close`` has not been logged (ties: the lowest index). Each fault fires at most once.
    Use it as a context manager around the batch; leaving it stops the thread (a removal under way
    finishes first).

    Args:
        plan: The faults; only its ``kill_node`` faults are used.
        spans: The span log that the faulted run's envs write.
        cluster: The cluster whose worker nodes are removed.
        poll_s: How often the span log is read.
    """

    def __init__(self, plan: FaultPlan, spans: SpanLog, cluster: Cluster, *, poll_s: float = 0.05) -> None:
        self.plan = plan
        self.spans = spans
        self.cluster = cluster
        self.poll_s = poll_s
        self._pending = plan.ray_faults("kill_node")
        self._workers: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gym-resilience-node-killer", daemon=True)
        self.error: BaseException | None = None
        """What stopped the watcher early (a removal that failed), re-raised when the block is left."""

    def __enter__(self) -> NodeKiller:
        if self._pending:
            self._workers = self.cluster.worker_node_ids()
            self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.error is not None and exc is None:
            raise self.error

    def _watch(self) -> None:
        try:
            while self._pending and not self._stop.wait(self.poll_s):
                spans = self.spans.read()
                steps = sum(1 for span in spans if span.kind == "step" and span.end_s is not None)
                due = [(i, f) for i, f in self._pending if steps >= f.after_steps]
                for index, fault in due:
                    self._kill(index, fault, spans, steps)
                    self._pending.remove((index, fault))
        except BaseException as exc:  # the batch goes on; the run reports this when the block is left
            self.error = exc

    def _kill(self, index: int, fault: RayFault, spans: Sequence[Span], steps: int) -> None:
        hosted = _actors_per_node(spans)
        if fault.node is not None:
            position = fault.node
        else:
            # The node hosting the most env actors; ties go to the lowest index.
            position = max(range(len(self._workers)), key=lambda i: (hosted.get(self._workers[i], 0), -i))
        node = self._workers[position]
        self.cluster.remove_node(node)
        self.plan.record(
            index,
            rollout=None,
            attempt=None,
            turn=None,
            detail=(
                f"removed worker node {position} ({node[:12]}), hosting {hosted.get(node, 0)} env actors, "
                f"after {steps} env steps"
            ),
        )


def _actors_per_node(spans: Sequence[Span]) -> dict[str, int]:
    """How many attempts' envs each node hosts: reset there, and not closed yet."""
    closed = {(s.rollout, s.attempt) for s in spans if s.kind == "close"}
    reset = {
        (s.rollout, s.attempt): s.node
        for s in spans
        if s.kind == "reset" and s.node is not None and s.rollout is not None and s.attempt is not None
    }
    counts: dict[str, int] = {}
    for (rollout, attempt), node in reset.items():
        if (rollout, attempt) not in closed:
            counts[node] = counts.get(node, 0) + 1
    return counts


# --- The engine wrapper. --------------------------------------------------------------------------------


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
