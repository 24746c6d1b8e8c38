"""The env wrapper: injects a plan's env faults, and ``kill_actor`` ray faults, into an env's calls.

A ``kill_actor`` is injected from inside the env's Ray actor: the wrapper SIGKILLs its own worker
process mid-step, so the driver sees the actor die during the call.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Final, SupportsFloat, TypeVar

import gymnasium

from gym_resilience import current_rollout
from gym_resilience.errors import UnsupportedConfigError
from gym_resilience.tasks import Task
from harness.faults.events import RunEvents, SpanKind, record_span, timed_call
from harness.faults.injectors import Injector, check_table
from harness.faults.plan import FaultPlan
from harness.scenario.spec import EnvFault

__all__ = [
    "BAD_RESET_OBSERVATION",
    "BAD_REWARD",
    "BAD_STEP_OBSERVATION",
    "ENV_INJECTORS",
    "HANG_S",
    "FaultyEnv",
    "FaultyEnvFactory",
    "ray_placement",
]

HANG_S: Final = 24 * 3600.0
"""How long a ``hang`` sleeps: past any deadline. Only an isolated env (a process to kill) survives it."""

BAD_RESET_OBSERVATION: Final = 12345
"""What a ``bad_output`` reset returns as its observation: an int, not chat messages."""
BAD_STEP_OBSERVATION: Final = {"text": "not a chat message"}
"""What a ``bad_output`` step returns as its observation: a dict with no ``role`` and no ``content``."""
BAD_REWARD: Final = "lots"
"""What a ``bad_output`` step returns as its reward: a string that ``float()`` rejects."""

T = TypeVar("T")


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
    """Injects a plan's env faults into ``reset``, ``step`` and ``close``, and reports a span per call.

    Fault kinds: ``raise`` (the named exception, built from the message), ``delay`` (sleep, then the
    real call), ``hang`` (sleep :data:`HANG_S`: only an isolated env, whose worker a deadline kills,
    gets past it), ``interrupt`` (``KeyboardInterrupt``), ``bad_output`` (the real call, whose result is
    then replaced: ``reset`` returns :data:`BAD_RESET_OBSERVATION`; ``step`` returns
    :data:`BAD_STEP_OBSERVATION` and :data:`BAD_REWARD`). Each kind is one entry of
    :data:`ENV_INJECTORS`: delays apply first; then the first other fault that fired, in scenario order,
    applies alone. On ``close`` the inner env is closed whatever
    the fault (but a hang), so an injected close failure leaks nothing. A ``kill_actor`` ray fault that
    fires on a ``step`` applies before all of them: the env's Ray actor SIGKILLs its own worker process.
    Where each call is (rollout, attempt, turn): see the module docstring.

    Args:
        env: The env to inject into.
        plan: The faults; None injects nothing (the wrapper then only reports spans).
        events: Where each call's span is reported (the run's recorder); None reports none.
        rollout: The rollout index to use when neither ``current_rollout()`` nor ``reset``'s options
            say (a user pipeline outside ``BatchRunner``: the task's index in the batch).
        sleep: How ``delay`` and ``hang`` sleep (tests inject a fake; it must pickle for isolated envs).

    Example:
        >>> from gym_resilience.task_gen import word_game_factory, generate_tasks
        >>> from harness.scenario.spec import EnvFault
        >>> task = generate_tasks(1, seed=0)[0]
        >>> plan = FaultPlan([EnvFault(target="env", kind="raise", exception="ConnectionResetError")],
        ...                  seed=0, exceptions={0: ConnectionResetError})
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
        events: RunEvents | None = None,
        rollout: int | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(env)
        self.plan = plan
        self.events = events
        self.fallback_rollout = rollout
        self.sleep = sleep
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

    def _span(
        self,
        kind: SpanKind,
        rollout: int | None,
        attempt: int | None,
        turn: int | None,
        node: str | None = None,
    ) -> AbstractContextManager[None]:
        return timed_call(self.events, kind, rollout=rollout, attempt=attempt, turn=turn, node=node)

    def never_ends(
        self, method: SpanKind, rollout: int | None, attempt: int | None, turn: int | None
    ) -> None:
        """Report the call now, with no end: it never returns (a hang, or a kill that ends this process
        before the call's own span is reported)."""
        if self.events is not None:
            now = time.time()
            record_span(
                self.events,
                method,
                rollout=rollout,
                attempt=attempt,
                turn=turn,
                started=now,
                ended=None,
                failed=True,
            )

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
        self.never_ends("step", rollout, attempt, turn)
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
        call = EnvCall(self, plan, method, rollout, attempt, turn, real)
        for index, fault in fired:
            if ENV_INJECTORS[fault.kind].phase == "before":
                ENV_INJECTORS[fault.kind].apply(call, index, fault)
        effect = next(((i, f) for i, f in fired if ENV_INJECTORS[f.kind].phase == "instead"), None)
        if effect is None:
            return real()
        index, fault = effect
        result: T = ENV_INJECTORS[fault.kind].apply(call, index, fault)
        return result


@dataclass(frozen=True)
class EnvCall:
    """One env call that faults hit: the env, where the call is, and the real call."""

    env: FaultyEnv
    plan: FaultPlan
    method: SpanKind
    rollout: int | None
    attempt: int | None
    turn: int | None
    real: Callable[[], Any]

    def fired(self, index: int, detail: str) -> None:
        self.plan.record(index, rollout=self.rollout, attempt=self.attempt, turn=self.turn, detail=detail)


def _delay(call: EnvCall, index: int, fault: EnvFault) -> None:
    call.fired(index, f"{call.method} delayed {fault.delay_s:g} s")
    call.env.sleep(fault.delay_s)


def _raise(call: EnvCall, index: int, fault: EnvFault) -> Any:
    error = call.plan.exception(index)
    call.fired(index, f"{call.method} raised {type(error).__name__}: {error}")
    raise error


def _interrupt(call: EnvCall, index: int, fault: EnvFault) -> Any:
    call.fired(index, f"{call.method} interrupted")
    raise KeyboardInterrupt(fault.message)


def _hang(call: EnvCall, index: int, fault: EnvFault) -> Any:
    call.fired(index, f"{call.method} hung")
    call.env.never_ends(call.method, call.rollout, call.attempt, call.turn)
    call.env.sleep(HANG_S)
    return call.real()


def _bad_output_call(call: EnvCall, index: int, fault: EnvFault) -> Any:
    """The env did its work, and its answer is garbage."""
    result = call.real()
    call.fired(index, f"{call.method} returned bad output")
    return _bad_output(call.method, result)


ENV_INJECTORS: Final[Mapping[str, Injector[EnvCall]]] = {
    "delay": Injector("before", _delay),
    "raise": Injector("instead", _raise),
    "interrupt": Injector("instead", _interrupt),
    "hang": Injector("instead", _hang),
    "bad_output": Injector("instead", _bad_output_call),
}
"""What each env fault kind does to the call it hits."""
check_table("env", ENV_INJECTORS)


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
    events: RunEvents | None = None
    sleep: Callable[[float], None] = time.sleep

    def __call__(self, task: Task) -> FaultyEnv:
        return FaultyEnv(
            self.base_factory(task),
            self.plan,
            events=self.events,
            rollout=self.index_of.get(task.instance_id),
            sleep=self.sleep,
        )
