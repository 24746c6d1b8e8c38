"""The rules between a scenario's fields: every fault must fit the engine, env, batch and runner it is meant
to hit, and the engine's own fields must fit its kind.

A rule that needs a part the file got wrong is skipped (that part has its own problem already), so a
file's problems are all reported at once without one of them causing others.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from gym_resilience.config import RunnerConfig
from harness.scenario.kinds import kind_of
from harness.scenario.messages import Loc, Problem
from harness.scenario.probe_names import METRICS_PREFIX
from harness.scenario.spec import (
    BatchSpec,
    ClusterSpec,
    EngineFault,
    EngineSpec,
    EnvFault,
    Fault,
    NetworkFault,
    Probe,
    RayFault,
)

__all__ = ["Known", "rule_problems"]


@dataclass(frozen=True)
class Known:
    """What the rules may rely on; None where the file got that part wrong."""

    faults: Sequence[tuple[int, Fault]]
    """Each valid fault with its index in the file."""
    config: RunnerConfig | None
    batch: BatchSpec | None
    engine: EngineSpec | None
    tasks: int | None
    """How many tasks the batch has."""
    pipeline: bool | None
    """Whether a user pipeline runs instead of BatchRunner."""
    cluster: ClusterSpec | None = None
    """The declared cluster; None when the file declares none (or ``cluster`` has a problem of its own)."""
    cluster_valid: bool = True
    """False when ``cluster`` has a problem of its own: the rules about it are then skipped."""
    probes: Sequence[Probe] = ()
    """The probes; empty when ``probes`` has a problem of its own."""


def rule_problems(known: Known) -> Iterator[Problem]:
    """Every rule the known parts break, fault by fault."""
    if known.engine is not None:
        yield from _engine_problems(known.engine)
    yield from _cluster_problems(known)
    yield from _probe_problems(known)
    for index, fault in known.faults:
        at: Loc = ("faults", index)
        if isinstance(fault, RayFault):
            yield from _ray_fault_problems(known, at, fault)
        elif isinstance(fault, NetworkFault):
            yield from _network_fault_problems(known, at, fault)
        kind = kind_of(fault)
        if kind.problems is not None:
            yield from kind.problems(known, at, fault)
        yield from _targeting_problems(known, at, fault)


def _cluster_problems(known: Known) -> Iterator[Problem]:
    """Envs in Ray actors and ray faults need the local cluster the harness starts: one problem, at the
    first field that needs it."""
    config, cluster = known.config, known.cluster
    if cluster is not None:
        yield from _envs_on_worker_problems(cluster, config)
    if cluster is not None or not known.cluster_valid:
        return
    if config is not None and config.env_backend == "ray":
        yield Problem(
            ("runner", "env_backend"),
            "env_backend 'ray' needs a cluster: declare cluster: {nodes: 2} (a local Ray cluster the "
            "harness starts on loopback for the scenario)",
        )
        return
    ray_faults = [index for index, fault in known.faults if isinstance(fault, RayFault)]
    if ray_faults:
        yield Problem(
            ("faults", ray_faults[0], "target"),
            "a ray fault needs a cluster: declare cluster: {nodes: 2} (a local Ray cluster the harness "
            "starts on loopback for the scenario)",
        )


def _probe_problems(known: Known) -> Iterator[Problem]:
    """``metrics.<key>`` reads the metrics ``BatchRunner`` returns; a user pipeline returns none, so such a
    probe would observe nothing, whatever the run did."""
    if not known.pipeline:
        return
    for index, probe in enumerate(known.probes):
        if probe.probe.startswith(METRICS_PREFIX):
            yield Problem(
                ("probes", index, "probe"),
                f"probe {probe.probe!r} reads BatchRunner's metrics, and a user pipeline runs instead, "
                "which gives none; remove pipeline to test BatchRunner, or probe the batch itself "
                "(batch_size, placeholders, envs_unclosed, ...)",
            )


def _engine_problems(engine: EngineSpec) -> Iterator[Problem]:
    given = engine.model_fields_set
    if "servers" in given and engine.kind != "served":
        yield Problem(
            ("engine", "servers"),
            f"servers only goes with kind 'served' (servers the harness starts), and kind is {engine.kind!r}",
        )
    if engine.endpoints is not None and engine.kind != "openai":
        yield Problem(
            ("engine", "endpoints"),
            f"endpoints only go with kind 'openai' (servers you run), and kind is {engine.kind!r}",
        )
    if engine.kind == "openai" and not engine.endpoints:
        yield Problem(
            ("engine", "kind"),
            "kind 'openai' needs endpoints: the URLs of the OpenAI-compatible servers you run on loopback "
            "(endpoints: [http://127.0.0.1:8000])",
        )
    for position, url in enumerate(engine.endpoints or []):
        if url in (engine.endpoints or [])[:position]:
            yield Problem(("engine", "endpoints", position), f"endpoint {url!r} is listed twice")


def _envs_on_worker_problems(cluster: ClusterSpec, config: RunnerConfig | None) -> Iterator[Problem]:
    worker = cluster.envs_on_worker
    if worker is None:
        return
    at: Loc = ("cluster", "envs_on_worker")
    if worker >= cluster.worker_nodes:
        yield Problem(
            at,
            f"worker node {worker} does not exist: the cluster has {cluster.worker_nodes} worker "
            f"node{'s' if cluster.worker_nodes != 1 else ''} (numbered from 0)",
        )
    if config is not None and config.env_backend != "ray":
        yield Problem(
            at,
            "envs_on_worker places env actors, and runner.env_backend is "
            f"{config.env_backend!r}: set it to 'ray'",
        )
    elif config is not None and "scheduling_strategy" in (config.env_actor_options or {}):
        yield Problem(
            at,
            "envs_on_worker sets the env actors' scheduling_strategy, and "
            "runner.env_actor_options.scheduling_strategy sets it too: give only one",
        )


_RAY_FIELDS = {"when": "kill_actor", "after_steps": "kill_node", "node": "kill_node"}
"""The ray fault fields that go with one kind only."""


def _ray_fault_problems(known: Known, at: Loc, fault: RayFault) -> Iterator[Problem]:
    config = known.config
    for name in sorted(fault.model_fields_set & _RAY_FIELDS.keys()):
        if _RAY_FIELDS[name] != fault.kind:
            yield Problem(
                (*at, name), f"{name} only goes with kind {_RAY_FIELDS[name]!r}, and kind is {fault.kind!r}"
            )
    if known.pipeline:
        yield Problem(
            (*at, "target"),
            "a ray fault needs BatchRunner: it hits the Ray actors BatchRunner runs envs in "
            "(runner.env_backend: ray), and a user pipeline builds its own envs",
        )
    elif config is not None and config.env_backend != "ray":
        yield Problem(
            (*at, "target"),
            "a ray fault needs runner.env_backend: ray: it hits the Ray actors the envs run in, and "
            f"env_backend is {config.env_backend!r}",
        )


def _network_fault_problems(known: Known, at: Loc, fault: NetworkFault) -> Iterator[Problem]:
    engine, batch = known.engine, known.batch
    if fault.link == "engine" and engine is not None:
        endpoints = engine.proxied_endpoints
        if endpoints == 0:
            yield Problem(
                (*at, "link"),
                "link 'engine' needs an engine behind HTTP (engine.kind: served or openai): the fault "
                f"proxy sits on the connections to its endpoints, and engine.kind is {engine.kind!r}",
            )
        elif fault.endpoint is not None and fault.endpoint >= endpoints:
            count = f"engine.servers is {endpoints}" if engine.kind == "served" else f"{endpoints} endpoints"
            yield Problem(
                (*at, "endpoint"),
                f"endpoint {fault.endpoint} does not exist: {count} (endpoints are numbered from 0)",
            )
    if fault.link == "tool" and fault.endpoint is not None:
        yield Problem((*at, "endpoint"), "endpoint only goes with link 'engine': the tool server is one")
    if fault.link == "tool" and batch is not None and batch.env != "tool_use":
        yield Problem(
            (*at, "link"),
            "link 'tool' needs batch.env: tool_use: only the bundled tool env talks to a tool server the "
            f"harness can put a proxy in front of, and batch.env is {batch.env!r}",
        )


def _targeting_problems(known: Known, at: Loc, fault: Fault) -> Iterator[Problem]:
    """A filter naming a rollout, turn or attempt the batch never has makes a fault that never fires, and
    a scenario whose fault never fires holds without testing anything (see ``harness.faults`` for where
    each call is, and ``harness.faults.proxy`` for a request's: a filter never matches a call whose coordinate
    is unknown)."""
    when = fault.when
    if known.pipeline and _is_engine_call(fault):
        # A request to the engine names no rollout outside BatchRunner, and then only a fault without
        # rollout filters or probability hits it (``harness.faults.request_fires``).
        instead = "nth_call or probability" if isinstance(fault, EngineFault) else "nth_connection"
        for name in ("rollouts", "attempts", "turns"):
            if getattr(when, name) is not None:
                yield Problem(
                    (*at, "when", name),
                    f"{name} never match here: in a user pipeline an engine call has no rollout, attempt "
                    f"or turn; target it with {instead}",
                )
        return
    if isinstance(fault, EnvFault) and fault.method == "reset" and when.turns is not None:
        yield Problem(
            (*at, "when", "turns"),
            "turns never match a reset fault: reset has no turn (turns count the steps since reset)",
        )
    for name, limit, why in _limits(known):
        values: list[int] | None = getattr(when, name)
        for position, value in enumerate(values or []):
            if value >= limit:
                singular = name.removesuffix("s")
                yield Problem((*at, "when", name, position), f"{singular} {value} never happens: {why}")


def _is_engine_call(fault: Fault) -> bool:
    """Whether the fault hits engine calls: an engine fault, or a network fault on the engine link (whose
    requests name their rollout only inside BatchRunner)."""
    return isinstance(fault, EngineFault) or (isinstance(fault, NetworkFault) and fault.link == "engine")


def _limits(known: Known) -> list[tuple[str, int, str]]:
    """(filter, how many there are, why) for each targeting filter whose range is known."""
    tasks, config = known.tasks, known.config
    if known.pipeline is None:
        return []
    if known.pipeline:
        limits = [("attempts", 1, "in a user pipeline every env call is attempt 0")]
        if tasks is not None:
            why = (
                f"in a user pipeline an env's rollout is its task's index, and the batch has {tasks} "
                "tasks (numbered from 0)"
            )
            limits.append(("rollouts", tasks, why))
        return limits
    if config is None:
        return []
    attempts = config.retry.attempts if config.retry is not None else 1
    limits = [
        (
            "attempts",
            attempts,
            f"a rollout gets {attempts} attempt{'s' if attempts != 1 else ''} "
            "(runner.retry.attempts, 1 without retry), numbered from 0",
        ),
        ("turns", config.max_turns, f"runner.max_turns is {config.max_turns} (turns are numbered from 0)"),
    ]
    if tasks is not None:
        rollouts = tasks * config.n_samples_per_prompt
        why = (
            f"the batch has {rollouts} rollouts ({tasks} tasks x runner.n_samples_per_prompt "
            f"{config.n_samples_per_prompt}), numbered from 0"
        )
        limits.insert(0, ("rollouts", rollouts, why))
    return limits
