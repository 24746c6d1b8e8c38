"""The fault kinds: one entry per (target, kind) holding everything the harness decides by kind.

Each stage reads its part of an entry instead of branching on the kind's name: the rules check
``problems``, the compiler resolves an exception class where ``raises``, the plan decides per call where
``per_call``, the run lets a ``KeyboardInterrupt`` out as the outcome where ``interrupts``, and the
judge blames a failed rollout on the firings that ``fails_call``. A new kind is one entry here, plus its
effect in the injector of its target (``harness.faults``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from harness.scenario.messages import Loc, Problem
from harness.scenario.spec import EngineFault, EnvFault, Fault, RayFault

if TYPE_CHECKING:
    from harness.scenario.rules import Known

__all__ = ["KINDS", "FaultKind", "kind_of"]

Target = Literal["env", "engine", "network", "ray"]


@dataclass(frozen=True)
class FaultKind:
    """What a fault kind is: where it hits, what it does to the call, and its own rules."""

    target: Target
    name: str
    description: str
    fails_call: bool
    """Whether the call it hits fails (a delay, a latency or an abort only slow or shorten it)."""
    raises: bool = False
    """Whether it raises the exception class the fault names (resolved when the scenario compiles)."""
    interrupts: bool = False
    """Whether it raises ``KeyboardInterrupt``, which the faulted run then reports as its outcome."""
    per_call: bool = True
    """Whether the plan decides it per env or engine call (``FaultPlan.fires``); network faults are
    decided per connection or request by the proxy, ``kill_node`` by the node killer."""
    problems: Callable[[Known, Loc, Any], Iterator[Problem]] | None = None
    """The rules that hold for this kind alone (the target's rules hold for every kind of it)."""


def _bad_output_problems(known: Known, at: Loc, fault: EnvFault) -> Iterator[Problem]:
    if fault.method == "close":
        yield Problem(
            (*at, "method"),
            "bad_output cannot target close: close() returns nothing, so the fault would do nothing",
        )


def _hang_problems(known: Known, at: Loc, fault: EnvFault) -> Iterator[Problem]:
    config = known.config
    if known.pipeline:
        yield Problem(
            (*at, "kind"),
            "a hang cannot be stopped in a user pipeline: its envs run in-process, where no deadline "
            "kills a hung call (runner settings such as isolate_envs and env_step_timeout_s apply to "
            "BatchRunner only), so the run would hang; remove pipeline to test BatchRunner, or use delay",
        )
        return
    if config is None:
        return
    # An env in its own process or in a Ray actor has a worker that a deadline can end.
    killable = config.env_backend != "thread"
    deadline = {"step": "env_step_timeout_s", "reset": "env_reset_timeout_s"}.get(fault.method)
    if deadline is None and not killable:
        yield Problem(
            (*at, "kind"),
            "a hang in close needs runner.isolate_envs: true: only an isolated env's close is killed "
            "at its deadline, and a close that never returns would hang the run",
        )
    elif deadline is not None and not (killable and getattr(config, deadline) is not None):
        yield Problem(
            (*at, "kind"),
            f"a hang in {fault.method} needs runner.isolate_envs: true and runner.{deadline} set: only a "
            "deadline that kills the env's process stops a hung call, and without one the run would hang",
        )


def _interrupt_problems(known: Known, at: Loc, fault: EnvFault) -> Iterator[Problem]:
    """asyncio re-raises a KeyboardInterrupt from a task out of the event loop, which ends the whole run,
    not the scenario: a user pipeline's envs run in its own tasks."""
    if known.pipeline:
        yield Problem(
            (*at, "kind"),
            "an interrupt cannot be contained in a user pipeline: a KeyboardInterrupt raised in a task "
            "it starts (asyncio.gather, create_task) escapes the event loop and ends the whole run, not "
            "this scenario; remove pipeline to test BatchRunner, or use raise",
        )


def _kill_problems(known: Known, at: Loc, fault: EngineFault) -> Iterator[Problem]:
    engine = known.engine
    if engine is None:
        return
    if engine.kind != "served":
        yield Problem(
            (*at, "kind"),
            "a kill fault needs a served engine (engine.kind: served): it SIGKILLs a vllm serve "
            f"process the harness started, and engine.kind is {engine.kind!r}",
        )
    elif fault.server >= engine.servers:
        yield Problem(
            (*at, "server"),
            f"server {fault.server} does not exist: engine.servers is {engine.servers} "
            "(servers are numbered from 0)",
        )


def _kill_node_problems(known: Known, at: Loc, fault: RayFault) -> Iterator[Problem]:
    config, cluster = known.config, known.cluster
    if fault.node is not None and cluster is not None and fault.node >= cluster.worker_nodes:
        yield Problem(
            (*at, "node"),
            f"worker node {fault.node} does not exist: the cluster has {cluster.worker_nodes} worker "
            f"node{'s' if cluster.worker_nodes != 1 else ''} (cluster.nodes {cluster.nodes} counts the "
            "head; worker nodes are numbered from 0)",
        )
    if config is not None and known.tasks is not None and not known.pipeline:
        steps = known.tasks * config.n_samples_per_prompt * config.max_turns
        if fault.after_steps >= steps:
            yield Problem(
                (*at, "after_steps"),
                f"after_steps {fault.after_steps} never happens: the batch makes at most {steps} env "
                f"steps ({known.tasks} tasks x runner.n_samples_per_prompt {config.n_samples_per_prompt} "
                f"x runner.max_turns {config.max_turns})",
            )


_ENTRIES: Final[tuple[FaultKind, ...]] = (
    FaultKind("env", "raise", "the call raises the named exception", fails_call=True, raises=True),
    FaultKind("env", "delay", "the call sleeps delay_s, then runs", fails_call=False),
    FaultKind("env", "hang", "the call sleeps past any deadline", fails_call=True, problems=_hang_problems),
    FaultKind(
        "env",
        "interrupt",
        "the call raises KeyboardInterrupt",
        fails_call=True,
        interrupts=True,
        problems=_interrupt_problems,
    ),
    FaultKind(
        "env",
        "bad_output",
        "the call runs, and returns values of the wrong types",
        fails_call=True,
        problems=_bad_output_problems,
    ),
    FaultKind("engine", "raise", "generate raises the named exception", fails_call=True, raises=True),
    FaultKind("engine", "delay", "generate sleeps delay_s, then runs", fails_call=False),
    FaultKind("engine", "abort", "the generation is cut in half, finish reason abort", fails_call=False),
    FaultKind(
        "engine",
        "kill",
        "a served vLLM process is SIGKILLed",
        fails_call=False,
        problems=_kill_problems,
    ),
    FaultKind("network", "latency", "each chunk is delayed latency_s", fails_call=False, per_call=False),
    FaultKind("network", "reset_peer", "the connection is reset", fails_call=True, per_call=False),
    FaultKind("network", "timeout", "data stops flowing", fails_call=True, per_call=False),
    FaultKind("ray", "kill_actor", "the env's Ray actor is SIGKILLed mid-step", fails_call=True),
    FaultKind(
        "ray",
        "kill_node",
        "a worker node is removed",
        fails_call=False,
        per_call=False,
        problems=_kill_node_problems,
    ),
)

KINDS: Final[Mapping[tuple[str, str], FaultKind]] = {(k.target, k.name): k for k in _ENTRIES}
"""Every fault kind by (target, kind)."""


def kind_of(fault: Fault) -> FaultKind:
    """The entry of ``fault``'s kind."""
    return KINDS[(fault.target, fault.kind)]
