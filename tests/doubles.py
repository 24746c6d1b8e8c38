"""The test env double, its ledger, and the one way to inject a fault into it.

``factory(counts, *faults)`` builds :class:`CountingTextEnv` envs, each counted in ``counts`` (an
:class:`EnvCounts`: built, being built, closed, closed twice); ``env_fn(*faults)`` is one such env for
``ResilientEnv.isolated``. A :class:`Fault` says where an env misbehaves (phase, tasks, turn, attempt) and
how (raise, hang, exit its process, ...); it is plain data, so factory and faults pickle into a worker
process or a Ray actor as they are. ``fail_on(...)`` and ``hang_on(...)`` are the short ways to write a
raising and a hanging one.

This is an importable module (not a test file) because a worker process unpickles factories, faults and
exceptions by reference: it imports this module by name, from the ``sys.path`` its fork server started with.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import threading
import time
from collections.abc import Callable, Collection
from typing import Any, Literal

import gymnasium
from gymnasium import spaces

from gym_resilience import Task

SETTLE_S = 10.0
"""How long a test waits for envs to wind down: generous, it only bounds a failure."""


@dataclasses.dataclass
class EnvCounts:
    """Envs built, being built and closed across a batch, thread-safe, so tests can check nothing leaked.

    ``closes`` counts the closes of each env by its number; ``building`` the factories running right now.
    It pickles as a copy: envs built in a worker process count there, not here.
    """

    created: int = 0
    building: int = 0
    closes: dict[int, int] = dataclasses.field(default_factory=dict)
    _changed: threading.Condition = dataclasses.field(default_factory=threading.Condition)

    def building_one(self, delta: int) -> None:
        with self._changed:
            self.building += delta
            self._changed.notify_all()

    def created_one(self) -> int:
        """Count a new env; its number."""
        with self._changed:
            number = self.created
            self.created += 1
            self.closes[number] = 0
            self._changed.notify_all()
            return number

    def closed_one(self, number: int) -> None:
        with self._changed:
            self.closes[number] += 1
            self._changed.notify_all()

    @property
    def closed(self) -> int:
        """Envs closed at least once."""
        return sum(1 for count in self.closes.values() if count >= 1)

    @property
    def open(self) -> int:
        """Envs built and never closed."""
        return self.created - self.closed

    def closed_more_than_once(self) -> int:
        return sum(1 for count in self.closes.values() if count > 1)

    def wait_for(self, predicate: Callable[[EnvCounts], bool], timeout_s: float = SETTLE_S) -> bool:
        """Wait until ``predicate(self)`` holds, at most ``timeout_s``; whether it does."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout_s)

    def __getstate__(self) -> dict[str, Any]:
        # A condition does not pickle; a copy in a worker process counts there, with a lock of its own.
        with self._changed:
            return {"created": self.created, "building": self.building, "closes": dict(self.closes)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _changed=threading.Condition())


FaultKind = Literal["raise", "hang", "exit", "spawn", "thread", "print", "unpicklable"]

EXIT_CODE = 3
"""The exit code of a worker process that an ``"exit"`` fault ends."""

HANG_S = 10**6
"""How long a ``"hang"`` fault sleeps: forever, for a test; only killing its process ends it sooner."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """What the envs of ``instances`` (every task's when None) do wrong in ``phase``, on ``turn`` (a step's
    0-based turn; any when None) of ``attempt`` (any when None).

    ``phase`` is ``"build"`` (in the factory), ``"reset"``, ``"step"`` or ``"close"`` (after the close
    is counted). ``kind`` says what happens there:

    - ``"raise"``: sleep ``sleep_s``, then raise ``error(message)`` (nothing when ``error`` is None);
    - ``"hang"``: never return, as a stuck tool call or a deadlocked simulator would;
    - ``"exit"``: end the process at once with :data:`EXIT_CODE`, as a crash in native code would;
    - ``"spawn"``: start a child process (a tool the env runs, which outlives the call) and go on;
    - ``"thread"``: start a thread that is no daemon and runs on (a server's, an executor's), and go on;
    - ``"print"``: print ``message`` to stdout and go on: a side effect another process can see;
    - ``"unpicklable"``: go on, with a lock in the call's info, so its result cannot leave a worker.

    ``error`` is an exception class, or any picklable callable from the message to an exception. Plain
    data: a fault pickles into a worker process or a Ray actor as it is, and fires there.
    """

    instances: frozenset[str] | None = None
    phase: str = "step"
    turn: int | None = None
    attempt: int | None = None
    kind: FaultKind = "raise"
    error: Callable[[str], BaseException] | None = ValueError
    message: str | None = None
    sleep_s: float = 0.0

    def fire(self, phase: str, instance_id: str, turn: int, attempt: int) -> dict[str, Any]:
        """Misbehave here if this is the fault's place; the info entries the call adds to its result."""
        if phase != self.phase or (self.instances is not None and instance_id not in self.instances):
            return {}
        if (self.turn is not None and turn != self.turn) or (self.attempt not in (None, attempt)):
            return {}
        if self.kind == "hang":
            time.sleep(HANG_S)
        elif self.kind == "exit":
            os._exit(EXIT_CODE)
        elif self.kind == "spawn":
            subprocess.Popen(["sleep", str(HANG_S)])
        elif self.kind == "thread":
            threading.Thread(target=time.sleep, args=(HANG_S,), daemon=False).start()
        elif self.kind == "print":
            print(self.message, flush=True)
        elif self.kind == "unpicklable":
            return {"lock": threading.Lock()}
        else:
            time.sleep(self.sleep_s)
            if self.error is not None:
                raise self.error(self.message or f"injected {phase} failure in {instance_id} at turn {turn}")
        return {}


def fail_on(
    instance_ids: Collection[str] | None,
    phase: str = "step",
    turn: int | None = 1,
    exc: Callable[[str], BaseException] | None = ValueError,
    **more: Any,
) -> Fault:
    """A :class:`Fault` raising ``exc`` (None: none, after ``sleep_s``) in ``phase`` on ``turn``."""
    instances = None if instance_ids is None else frozenset(instance_ids)
    return Fault(instances=instances, phase=phase, turn=turn, error=exc, **more)


def hang_on(instance_ids: Collection[str] | None, phase: str = "step") -> Fault:
    """A :class:`Fault` that hangs the envs of ``instance_ids`` (all when None) in ``phase``, on any turn."""
    instances = None if instance_ids is None else frozenset(instance_ids)
    return Fault(instances=instances, phase=phase, kind="hang")


class SandboxError(Exception):
    """An exception that holds a lock, so it cannot be pickled out of a worker."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


class ToolError(Exception):
    """Pickles, but cannot be unpickled: ``__init__`` takes other arguments than ``args``."""

    def __init__(self, tool: str, code: int) -> None:
        super().__init__(f"{tool} exited with {code}")


def tool_exited_2(tool: str) -> ToolError:
    """A :class:`ToolError` of ``tool`` exiting with 2: a fault's ``error`` gets one argument, the message."""
    return ToolError(tool, 2)


class CountingTextEnv(gymnasium.Env[list[dict[str, str]], str]):
    """A multi-turn text env: echoes the turn number, rewards by the action's length, ends after ``turns``."""

    def __init__(self, task: Task, counts: EnvCounts, faults: Collection[Fault] = (), turns: int = 3) -> None:
        self.task = task
        self.counts = counts
        self.faults = tuple(faults)
        self.turns = turns
        self.turn = 0
        self.attempt = 0
        self.observation_space = spaces.Text(4096)  # type: ignore[assignment]
        self.action_space = spaces.Text(4096)
        self.number = counts.created_one()

    def _faults(self, phase: str, turn: int) -> dict[str, Any]:
        info: dict[str, Any] = {}
        for fault in self.faults:
            info |= fault.fire(phase, self.task.instance_id, turn, self.attempt)
        return info

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[dict[str, str]], dict[str, Any]]:
        super().reset(seed=seed)
        self.turn = 0
        self.attempt = (options or {}).get("attempt", 0)
        return list(self.task.prompt), self._faults("reset", 0)

    def step(self, action: str) -> tuple[list[dict[str, str]], float, bool, bool, dict[str, Any]]:
        info = self._faults("step", self.turn)
        self.turn += 1
        reward = (len(action) % 5) / 4
        observation = [{"role": "user", "content": f"turn {self.turn} done"}]
        return observation, reward, self.turn >= self.turns, False, {"turn": self.turn, **info}

    def close(self) -> None:
        self.counts.closed_one(self.number)
        self._faults("close", self.turn)


@dataclasses.dataclass(frozen=True)
class Factory:
    """The env factory :func:`factory` makes.

    It pickles (when ``delay`` does), so a runner can build its envs in worker processes or Ray actors.
    """

    counts: EnvCounts
    faults: tuple[Fault, ...] = ()
    turns: int = 3
    env: type[CountingTextEnv] = CountingTextEnv
    delay: Callable[[Task], None] | None = None

    def __call__(self, task: Task) -> CountingTextEnv:
        self.counts.building_one(1)
        try:
            if self.delay is not None:
                self.delay(task)
            for fault in self.faults:
                fault.fire("build", task.instance_id, 0, 0)
            return self.env(task, self.counts, self.faults, self.turns)
        finally:
            self.counts.building_one(-1)


def factory(
    counts: EnvCounts,
    *faults: Fault,
    turns: int = 3,
    env: type[CountingTextEnv] = CountingTextEnv,
    delay: Callable[[Task], None] | None = None,
) -> Factory:
    """An env factory of ``env`` envs counted in ``counts``, failing where ``faults`` say.

    ``delay(task)`` runs first in the factory (a gate a test opens, a slow sandbox); ``"build"`` faults
    fire after it. ``counts.building`` counts the factories running meanwhile.
    """
    return Factory(counts, faults, turns, env, delay)


def env_fn(*faults: Fault, turns: int = 3, task: Task | None = None) -> functools.partial[CountingTextEnv]:
    """A zero-argument factory of one env (of ``task``, ``t0`` by default) failing where ``faults`` say:
    what :meth:`ResilientEnv.isolated` takes. It pickles; the worker counts its env in a copy of a ledger."""
    return functools.partial(factory(EnvCounts(), *faults, turns=turns), task or tasks(1)[0])


def tasks(n: int, prefix: str = "t") -> list[Task]:
    return [
        Task(
            prompt=[{"role": "user", "content": f"task number {i}, please answer"}],
            instance_id=f"{prefix}{i}",
        )
        for i in range(n)
    ]


def resilient_env_of(env_factory: Callable[[], gymnasium.Env[Any, Any]], task: Task | None = None) -> Any:
    """A factory's env in a ``ResilientEnv`` of its own, as a factory returns it for reset retries."""
    from gym_resilience import ResilientEnv

    return ResilientEnv(env_factory())
