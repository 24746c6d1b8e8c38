"""Replays a compiled scenario: a fault-free baseline and a faulted run on the same engine, then the probes.

Decoding is greedy in both runs, so a successful trajectory of the faulted run must equal the
baseline's token for token. Engines are shared across the scenarios of a run (``Bench``), keyed by
what they serve: starting vLLM costs tens of seconds, a scenario a few.

Everything the scenario names was resolved when it was compiled (``harness.compile``): the runner
configuration, the exception classes, the user's env factory, tasks and pipeline, the model folder.
Faults reach the user's parts as they reach the bundled ones: the env factory (bundled or the user's)
is wrapped in the fault injector and the env ledger, the engine in the engine fault injector, and a
user pipeline is handed both.

A scenario that declares a ``cluster`` runs both its runs on a local multi-node Ray cluster started for
it alone (``harness.cluster``), which needs this process in a loopback-only network namespace: the CLI
and the pytest plugin enter one at startup (:func:`enter_cluster_namespace`), before any thread or server
starts, so everything else the harness runs on 127.0.0.1 lives in it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from gym_resilience import (
    AnyTrajectory,
    AttemptRecord,
    BatchOutput,
    BatchRunner,
    RunnerConfig,
    StepWiseTrajectory,
    Task,
    build_batch_output,
    describe_exception,
    rollout_headers,
    root_cause,
)
from gym_resilience.engines import Engine
from gym_resilience.envs import ToolServer
from gym_resilience.task_gen import tool_env_factory, word_game_factory
from harness.compare import compare_outputs
from harness.compile import CompiledScenario
from harness.endpoints import EndpointWatch
from harness.faults import (
    FaultPlan,
    FaultyEngine,
    FaultyEnvFactory,
    NodeKiller,
    SpanLog,
    build_rollout_spans,
    read_firings,
)
from harness.ledger import EnvLedger
from harness.probes import RunOutcome, Runs, attempt_nodes, observations
from harness.proxy import FaultProxy
from harness.results import Attempt, ClusterNode, FaultFiring, ProbeResult, RolloutSpan, ScenarioResult
from harness.spec import EnvFault, NetworkFault

if TYPE_CHECKING:
    from harness.cluster import LocalCluster

__all__ = [
    "Bench",
    "ClusterUnavailableError",
    "RunOutcome",
    "attempt_records",
    "enter_cluster_namespace",
    "judge",
    "rollout_records",
    "run_batch",
    "run_scenario",
    "run_scenarios",
]

SETTLE_S: Final = 10.0
"""How long, at most, the counts of actors and envs left after a run on a cluster wait for killed actors
to die (Ray kills asynchronously, and a killed actor's process exits after it is marked dead); a leaked
actor or env is still there past it."""

# Firings that make the call they hit fail (a delay, a latency or an abort only slow or shorten it).
_FAILING_KINDS = frozenset(
    {"raise", "interrupt", "bad_output", "hang", "reset_peer", "timeout", "kill_actor"}
)


@dataclass
class _Served:
    servers: list[Any]

    def kill(self, index: int) -> None:
        self.servers[index].kill()

    async def revive(self) -> None:
        for server in self.servers:
            if not server.is_running:
                server.start()
        for server in self.servers:
            await asyncio.to_thread(server.wait_healthy)


@dataclass
class Bench:
    """The engines a run shares, keyed by what they serve: in-process vLLM engines by (model folder,
    context length), served vLLM servers by (count, model folder, context length). Endpoints the user
    runs are not started here. A killed server is started again when the next scenario needs it.
    """

    device: Literal["cpu", "cuda"] = "cpu"
    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    _local: dict[tuple[Path, int], Engine] = field(default_factory=dict)
    _served: dict[tuple[int, Path, int], _Served] = field(default_factory=dict)
    _tiny_model: Path | None = None

    def model_dir(self, scenario: CompiledScenario) -> Path:
        """The model folder ``scenario`` runs on: its own, or the bundled tiny model (built once)."""
        if scenario.model_dir is not None:
            return scenario.model_dir
        if self._tiny_model is None:
            from gym_resilience.models import build_tiny_model

            self._tiny_model = build_tiny_model()
        return self._tiny_model

    async def local(self, model_dir: Path, max_model_len: int) -> Engine:
        key = (model_dir, max_model_len)
        if key not in self._local:
            from gym_resilience.engines import make_vllm_engine

            # In-process on CPU: it starts in a third of the time of vLLM's async engine (README).
            engine = make_vllm_engine(model_dir, device=self.device, max_model_len=max_model_len)
            self._local[key] = await self._stack.enter_async_context(engine)
        return self._local[key]

    async def served(self, servers: int, model_dir: Path, max_model_len: int) -> _Served:
        key = (servers, model_dir, max_model_len)
        if key not in self._served:
            from gym_resilience.engines.vllm_server import servers as start_servers

            pool = await self._stack.enter_async_context(
                start_servers(servers, model_dir, device=self.device, max_model_len=max_model_len)
            )
            self._served[key] = _Served(list(pool))
        served = self._served[key]
        await served.revive()
        return served

    async def aclose(self) -> None:
        await self._stack.aclose()


class ClusterUnavailableError(RuntimeError):
    """Raised when a scenario declares a cluster and this process is not in a loopback-only network
    namespace, the only place the harness starts a Ray cluster."""


def enter_cluster_namespace() -> str | None:
    """Moves the calling thread into a loopback-only network namespace, where scenarios that declare a
    cluster can run; returns why it could not (those scenarios then fail, saying so), or None.

    Call it before any thread or server starts: threads started earlier stay outside, and a server
    listening outside is out of reach from inside.
    """
    from harness.netns import LoopbackNamespaceError, enter_loopback_namespace

    try:
        enter_loopback_namespace()
    except LoopbackNamespaceError as exc:
        return f"cannot run scenarios that declare a cluster: {exc.strerror}"
    return None


@contextlib.contextmanager
def _cluster_for(scenario: CompiledScenario) -> Iterator[LocalCluster | None]:
    """The scenario's local Ray cluster, started for it and shut down after it; None if it declares none."""
    spec = scenario.spec.cluster
    if spec is None:
        yield None
        return
    from harness.netns import in_loopback_namespace

    if not in_loopback_namespace():
        raise ClusterUnavailableError(
            "the scenario declares a cluster, and the harness starts Ray clusters only inside a "
            "loopback-only network namespace, which it enters at startup when it can: that needs "
            "CAP_SYS_ADMIN (run as root, or under `unshare --user --map-root-user --net`)"
        )
    from harness.cluster import LocalCluster

    # Env actors import the user's env factory by name, from the folders the scenario imports it from.
    folder = scenario.file.parent.absolute()
    folders = [folder, *(folder / Path(entry).expanduser() for entry in scenario.spec.python_path)]
    inherited = os.environ.get("PYTHONPATH")
    path = os.pathsep.join([*(str(f) for f in folders), *([inherited] if inherited else [])])
    with LocalCluster(
        spec.nodes, cpus_per_node=spec.cpus_per_node, environment={"PYTHONPATH": path}
    ) as cluster:
        yield cluster


def _placed(config: RunnerConfig, scenario: CompiledScenario, cluster: LocalCluster | None) -> RunnerConfig:
    """``config`` with the env actors pinned to the worker node ``cluster.envs_on_worker`` names, if any."""
    spec = scenario.spec.cluster
    if cluster is None or spec is None or spec.envs_on_worker is None:
        return config
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = cluster.worker_node_ids()[spec.envs_on_worker]
    strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
    options = {**(config.env_actor_options or {}), "scheduling_strategy": strategy}
    return dataclasses.replace(config, env_actor_options=options)


def _settled(count: Callable[[], int]) -> int:
    """``count()`` once it is 0, or after :data:`SETTLE_S`, whichever comes first."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        left = count()
        if left == 0 or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _base_factory(scenario: CompiledScenario, tool_url: str | None) -> Callable[[Task], Any]:
    if scenario.env_factory is not None:
        return scenario.env_factory
    if scenario.spec.batch.env == "tool_use" and tool_url is not None:
        return tool_env_factory(tool_url)
    return word_game_factory


def _raised_by_the_run(error: BaseException, interrupts: bool) -> bool:
    """Whether ``error``, raised out of a run's batch, is that run's outcome rather than the end of the
    whole chaos run: any ``Exception``; a ``KeyboardInterrupt`` only where interrupt faults raise it; a
    ``SystemExit`` or another ``BaseException`` the scenario's env or pipeline raised (nothing the harness
    runs raises one); an ``asyncio.CancelledError`` unless this task is being cancelled (Ctrl-C: asyncio
    cancels the main task). A ``GeneratorExit`` is a coroutine being closed: it always goes on."""
    if isinstance(error, Exception):
        return True
    if isinstance(error, KeyboardInterrupt):
        return interrupts
    if isinstance(error, asyncio.CancelledError):
        task = asyncio.current_task()
        return task is None or task.cancelling() == 0
    return not isinstance(error, GeneratorExit)


def _ends_the_chaos_run(error: BaseException | None, interrupts: bool) -> bool:
    """Whether a run's ``error`` would have ended the whole chaos run had the harness not caught it: a
    ``BaseException`` that is not an ``Exception``, but the ``KeyboardInterrupt`` of interrupt faults."""
    if error is None or isinstance(error, Exception):
        return False
    return not (interrupts and isinstance(error, KeyboardInterrupt))


class _ContainedExit(Exception):
    """Raised by a task the user's pipeline started instead of its ``SystemExit`` (the ``__cause__``),
    which asyncio would re-raise out of the event loop, ending the whole chaos run with no reports."""


@contextlib.contextmanager
def _exits_contained(exits: list[BaseException]) -> Iterator[None]:
    """While the user's pipeline is called, every task it starts (``asyncio.gather``, ``create_task``)
    turns a ``SystemExit`` its code raises (``sys.exit()`` in an env) into a ``_ContainedExit``, and adds
    it to ``exits``: the run's error, however the pipeline handles its tasks' errors."""
    loop = asyncio.get_running_loop()
    previous = loop.get_task_factory()

    async def contained(coro: Any) -> Any:
        try:
            return await coro
        except SystemExit as exc:
            exits.append(exc)
            raise _ContainedExit(f"the task raised {describe_exception(exc)}") from exc

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Future[Any]:
        if previous is not None:
            return previous(loop, contained(coro), **kwargs)
        return asyncio.Task(contained(coro), loop=loop, **kwargs)

    loop.set_task_factory(factory)
    try:
        yield
    finally:
        loop.set_task_factory(previous)


def _normalise(produced: Any) -> tuple[list[AnyTrajectory] | None, BatchOutput]:
    if isinstance(produced, BatchOutput):
        return None, produced
    trajectories = list(produced)
    return trajectories, build_batch_output(trajectories)


@contextlib.asynccontextmanager
async def _engine_for(
    scenario: CompiledScenario, bench: Bench, proxies: contextlib.ExitStack, plan: FaultPlan
) -> AsyncIterator[tuple[Engine, Callable[[int], None] | None, Callable[[], int], EndpointWatch | None]]:
    """The scenario's engine for one run: in-process, or an ``OpenAIEngine`` over the served or given
    endpoints (each through a fault proxy when a network fault of ``plan`` targets the engine link)."""
    spec = scenario.spec.engine
    model_dir = bench.model_dir(scenario)
    if spec.kind == "vllm":
        yield await bench.local(model_dir, spec.max_model_len), None, lambda: 0, None
        return
    from gym_resilience.engines.openai import OpenAIEngine

    kill: Callable[[int], None] | None = None
    if spec.kind == "served":
        served = await bench.served(spec.servers, model_dir, spec.max_model_len)
        urls, kill = [server.url for server in served.servers], served.kill
    else:
        urls = list(spec.endpoints or [])
    faults = plan.network_faults("engine")
    if faults:
        urls = [
            proxies.enter_context(
                FaultProxy(url, [(i, f) for i, f in faults if f.endpoint in (None, endpoint)], plan)
            ).url
            for endpoint, url in enumerate(urls)
        ]
    async with OpenAIEngine(urls, tokenizer_dir=model_dir, headers=rollout_headers) as engine:
        watch = EndpointWatch(lambda: engine.stats, plan.start)
        async with watch.watching():
            yield engine, kill, lambda: engine.stats.failovers, watch


async def run_batch(
    scenario: CompiledScenario,
    bench: Bench,
    *,
    config: RunnerConfig,
    with_faults: bool,
    workdir: Path,
    cluster: LocalCluster | None = None,
) -> RunOutcome:
    """Run the scenario's batch once, with or without its faults; never raises what the batch raised.

    ``cluster`` is the scenario's Ray cluster, whose nodes ``kill_node`` faults remove.
    """
    label = "faulted" if with_faults else "baseline"
    plan = FaultPlan(
        scenario.faults if with_faults else [],
        seed=scenario.spec.seed,
        log_path=workdir / f"{label}-firings.jsonl",
        start=time.time(),
        exceptions=scenario.exceptions if with_faults else None,
    )
    spans = SpanLog(workdir / f"{label}-spans.jsonl", start=plan.start)
    ledger = EnvLedger(workdir / f"{label}-envs.jsonl")
    tasks = list(scenario.tasks)
    index_of = {task.instance_id: index for index, task in enumerate(tasks)}
    interrupts = with_faults and any(getattr(f, "kind", "") == "interrupt" for f in scenario.faults)
    with contextlib.ExitStack() as stack:
        tool_url = None
        if scenario.spec.batch.env == "tool_use":
            tool_url = stack.enter_context(ToolServer()).url
            tool_faults = plan.network_faults("tool")
            if tool_faults:
                tool_url = stack.enter_context(FaultProxy(tool_url, tool_faults, plan)).url
        factory = ledger.factory(FaultyEnvFactory(_base_factory(scenario, tool_url), plan, index_of, spans))
        async with _engine_for(scenario, bench, stack, plan) as (engine, kill, failovers, watch):
            faulty = FaultyEngine(engine, plan, kill=kill, spans=spans)
            before = failovers()
            start = time.perf_counter()
            trajectories: list[AnyTrajectory] | None = None
            output: BatchOutput | None = None
            metrics: dict[str, float] = {}
            attempts: list[AttemptRecord] = []
            error: BaseException | None = None
            exits: list[BaseException] = []
            workers = cluster.worker_node_ids() if cluster is not None else []
            if cluster is not None:
                stack.enter_context(NodeKiller(plan, spans, cluster))
            try:
                if scenario.pipeline is not None:
                    with _exits_contained(exits):
                        produced = await scenario.pipeline(tasks, factory, faulty)
                    trajectories, output = _normalise(produced)
                else:
                    result = await BatchRunner(faulty, factory, config).generate(tasks)
                    trajectories, output, metrics = result.trajectories, result.output, result.metrics
                    attempts = list(result.attempts)
            except BaseException as exc:
                if not _raised_by_the_run(exc, interrupts):
                    raise
                error = exc
            if exits:  # a task of the pipeline's ended in SystemExit, whatever the pipeline made of it
                error = exits[0]
            wall_s = time.perf_counter() - start
            end_s = time.time() - plan.start
            moved = failovers() - before
            endpoints = watch.finish() if watch is not None else []
    actors_alive = envs_unclosed = None
    nodes: list[ClusterNode] = []
    if cluster is not None:
        actors_alive = _settled(lambda: len(cluster.alive_actors()))
        envs_unclosed = _settled(ledger.unclosed)
        left = set(cluster.worker_node_ids())
        nodes = [ClusterNode(cluster.head_node_id, "head")]
        nodes += [ClusterNode(node, f"worker {i}", node not in left) for i, node in enumerate(workers)]
    return RunOutcome(
        trajectories=trajectories,
        output=output,
        metrics=metrics,
        error=error,
        wall_s=wall_s,
        envs_created=ledger.created(),
        envs_unclosed=ledger.unclosed() if envs_unclosed is None else envs_unclosed,
        firings=read_firings(plan.log_path),
        spans=spans.read(),
        failovers=moved,
        end_s=end_s,
        endpoints=endpoints,
        actors_alive=actors_alive,
        head_node=cluster.head_node_id if cluster is not None else None,
        attempts=attempts,
        nodes=nodes,
    )


def _latency_per_rollout(scenario: CompiledScenario, firings: Sequence[FaultFiring]) -> float | None:
    """The most network latency the faults injected into one rollout's requests, which run one after
    another (each delayed request waited at least ``latency_s``); None when no latency hit a rollout."""
    totals: dict[int, float] = {}
    for firing in firings:
        fault = scenario.faults[firing.fault]
        if isinstance(fault, NetworkFault) and fault.kind == "latency" and firing.rollout is not None:
            totals[firing.rollout] = totals.get(firing.rollout, 0.0) + fault.latency_s
    return max(totals.values(), default=None)


def _outcome_probe(scenario: CompiledScenario, faulted: RunOutcome) -> ProbeResult:
    expect = scenario.spec.expect
    observed = "completes" if faulted.error is None else f"raises {type(faulted.error).__name__}"
    if scenario.expected_error is None:
        return ProbeResult("outcome", "completes", observed, faulted.error is None)
    held = isinstance(faulted.error, scenario.expected_error)
    return ProbeResult("outcome", f"raises {expect.error}", observed, held)


def _spec_as_run(scenario: CompiledScenario) -> dict[str, Any]:
    """The scenario as the journal keeps it (``chaos record`` reads it): what the file says, with the
    folders it names made absolute, so a scenario recorded from it into another folder still finds them."""
    spec = scenario.spec
    data = spec.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    folder = scenario.file.parent.absolute()
    if scenario.model_dir is not None:
        data["model"] = str(scenario.model_dir)
    if isinstance(spec.batch.tasks, str) and spec.batch.tasks.endswith(".jsonl"):
        data["batch"]["tasks"] = str(folder / Path(spec.batch.tasks).expanduser())
    if spec.python_path or _names_user_code(scenario):
        extra = [str(folder / Path(entry).expanduser()) for entry in spec.python_path]
        data["python_path"] = [str(folder), *extra]
    return data


def _names_user_code(scenario: CompiledScenario) -> bool:
    """Whether the scenario imports the user's modules (a ``module:name`` anywhere)."""
    spec = scenario.spec
    retry = spec.runner.get("retry")
    names = [spec.pipeline, spec.batch.env, spec.batch.tasks, spec.expect.error]
    names += [getattr(fault, "exception", None) for fault in spec.faults]
    names += list(retry.get("retry_on", [])) if isinstance(retry, dict) else []
    return any(isinstance(name, str) and ":" in name for name in names)


async def run_scenario(scenario: CompiledScenario, bench: Bench) -> ScenarioResult:
    """Run one scenario (baseline, then faulted) and judge it; harness failures become status 'error'."""
    try:
        # Greedy, so the runs can be compared token for token; logprobs, so a numerical tie between
        # two tokens can be told from a real difference (harness.compare).
        config = dataclasses.replace(scenario.config, temperature=0.0, logprobs=True)
        with (
            tempfile.TemporaryDirectory(prefix="gym-resilience-chaos-") as tmp,
            _cluster_for(scenario) as cluster,
        ):
            runs = {
                with_faults: await run_batch(
                    scenario,
                    bench,
                    config=_placed(config, scenario, cluster),
                    with_faults=with_faults,
                    workdir=Path(tmp),
                    cluster=cluster,
                )
                for with_faults in (False, True)
            }
        return judge(scenario, config, runs[False], runs[True])
    except Exception as exc:
        result = ScenarioResult(file=str(scenario.file), title=scenario.title, status="error")
        result.spec = _spec_as_run(scenario)
        result.message = describe_exception(root_cause(exc))
        return result


def judge(
    scenario: CompiledScenario, config: RunnerConfig, baseline: RunOutcome, faulted: RunOutcome
) -> ScenarioResult:
    """The result of a scenario's two runs: probes, firings, each rollout's calls and fate, status.

    Every report reads this one result, so the journal, JUnit and the timelines cannot disagree.
    """
    result = ScenarioResult(file=str(scenario.file), title=scenario.title, status="error")
    result.spec = _spec_as_run(scenario)
    samples = 1 if scenario.pipeline is not None else config.n_samples_per_prompt
    n_rollouts = len(scenario.tasks) * samples
    comparison = compare_outputs(baseline.output, faulted.output)
    observed = observations(
        Runs(
            baseline=baseline,
            faulted=faulted,
            comparison=comparison,
            num_prompts=len(scenario.tasks) * config.n_samples_per_prompt,
            step_wise=config.step_wise,
            injected_latency_s=_latency_per_rollout(scenario, faulted.firings),
        ),
        [p.probe for p in scenario.spec.probes],
    )
    details = {"identical_to_baseline": comparison.describe(), "numerical_ties": comparison.describe()}
    details.update(observed.unobservable)
    probes = [_outcome_probe(scenario, faulted)]
    probes += [
        ProbeResult(
            p.probe,
            p.describe(),
            observed.values.get(p.probe),
            p.holds(observed.values.get(p.probe)),
            details.get(p.probe, ""),
        )
        for p in scenario.spec.probes
    ]
    index_of = {task.instance_id: index for index, task in enumerate(scenario.tasks)}
    result.probes = probes
    result.firings = faulted.firings
    result.rollouts = rollout_records(faulted, n_rollouts, index_of, samples)
    result.baseline_rollouts = rollout_records(baseline, n_rollouts, index_of, samples)
    result.attempts = attempt_records(faulted)
    result.baseline_attempts = attempt_records(baseline)
    result.nodes = faulted.nodes or baseline.nodes
    result.endpoints = faulted.endpoints
    result.outcome = probes[0].observed
    result.baseline_s, result.faulted_s = baseline.wall_s, faulted.wall_s
    result.status = "held" if all(p.held for p in probes) else "deviated"
    escaped = _escaped(scenario, baseline, faulted)
    if escaped is not None:
        result.status = "error"
        result.message = escaped
    elif baseline.error is not None:
        result.status = "error"
        result.message = f"the fault-free baseline failed: {describe_exception(root_cause(baseline.error))}"
    elif _env_faults_unreachable(scenario, faulted):
        result.status = "error"
        result.message = (
            "the env faults could not fire: the pipeline built no env with the env_factory it was given "
            "(build every env with env_factory(task), so that faults and the env ledger reach it)"
        )
    return result


def _escaped(scenario: CompiledScenario, baseline: RunOutcome, faulted: RunOutcome) -> str | None:
    """Why the scenario is an error when a run raised what would have ended the whole chaos run (see
    ``_ends_the_chaos_run``); None when neither did."""
    interrupts = any(getattr(fault, "kind", "") == "interrupt" for fault in scenario.faults)
    for run, error, allowed in (
        ("fault-free baseline", baseline.error, False),
        ("faulted run", faulted.error, interrupts),
    ):
        if error is not None and _ends_the_chaos_run(error, allowed):
            return (
                f"the {run} raised {describe_exception(error)} in the scenario's env or pipeline: a "
                "BaseException that is not an Exception (sys.exit(), asyncio.CancelledError) would end "
                "the whole chaos run, so it is this scenario's error; raise an Exception instead"
            )
    return None


def _env_faults_unreachable(scenario: CompiledScenario, faulted: RunOutcome) -> bool:
    env_faults = {index for index, fault in enumerate(scenario.faults) if isinstance(fault, EnvFault)}
    fired = any(firing.fault in env_faults for firing in faulted.firings)
    return scenario.pipeline is not None and bool(env_faults) and not fired and faulted.envs_created == 0


def rollout_records(
    outcome: RunOutcome, n_rollouts: int, index_of: Mapping[str, int], samples: int
) -> list[RolloutSpan]:
    """Each rollout of a run: its calls (from the span log, each with the Ray node its attempt's env ran
    on, from the runner's attempt records), whether a placeholder stands in for it (the batch's
    ``is_placeholder`` column, whoever built the batch) and why it failed (the trajectory's failure, else
    the fault that broke its last call).

    A row's rollout is ``task index x samples + repetition`` by its trajectory id, or its position in
    the batch when it has none (``samples``: rollouts per task; 1 for a user pipeline).
    """
    rollouts = build_rollout_spans(outcome.spans, n_rollouts, until_s=outcome.end_s)
    nodes = attempt_nodes(outcome.attempts)
    if nodes:  # each call carries the node of its attempt's env
        for record in rollouts:
            where = [nodes.get((record.index, span.attempt)) for span in record.spans]
            record.spans = [dataclasses.replace(s, node=n) for s, n in zip(record.spans, where, strict=True)]
    output = outcome.output
    if output is not None:
        for row, index in enumerate(_row_rollouts(output, index_of, samples)):
            if 0 <= index < n_rollouts and output.is_placeholder[row]:
                rollouts[index].placeholder = True
    failures = _failures(outcome.trajectories or [], index_of, samples)
    for record in rollouts:
        error = failures.get(record.index)
        if error is None and (record.placeholder or outcome.error is not None):
            error = _injected_failure(outcome.firings, record.index)
        record.error = error
    return rollouts


def attempt_records(outcome: RunOutcome) -> list[Attempt]:
    """Every attempt of every rollout of a run, as the runner recorded it (``BatchResult.attempts``),
    failed ones included, with the node its env ran on."""
    return [
        Attempt(
            rollout=record.rollout_index,
            attempt=record.attempt,
            node=record.node_id,
            phase=record.phase,
            elapsed_s=record.elapsed_s,
            error=record.error,
        )
        for record in outcome.attempts
    ]


def _rollout_of(trajectory_id: Any, fallback: int, index_of: Mapping[str, int], samples: int) -> int:
    instance_id = getattr(trajectory_id, "instance_id", None)
    repetition = getattr(trajectory_id, "repetition", 0)
    if (
        isinstance(instance_id, str)
        and instance_id in index_of
        and isinstance(repetition, int)
        and 0 <= repetition < samples
    ):
        return index_of[instance_id] * samples + repetition
    return fallback


def _row_rollouts(output: BatchOutput, index_of: Mapping[str, int], samples: int) -> list[int]:
    """The rollout of each row of ``output`` (a step-wise rollout's rows end at ``is_last_step``)."""
    rollouts = []
    position = 0
    for row in range(len(output)):
        trajectory_id = output.trajectory_ids[row] if row < len(output.trajectory_ids) else None
        rollouts.append(_rollout_of(trajectory_id, position, index_of, samples))
        last = output.is_last_step[row] if output.is_last_step is not None else True
        position += 1 if last else 0
    return rollouts


def _failures(
    trajectories: Sequence[AnyTrajectory], index_of: Mapping[str, int], samples: int
) -> dict[int, str]:
    """``Type: message`` (the message ends with the root cause) of each failed rollout's failure record."""
    failures: dict[int, str] = {}
    for position, trajectory in enumerate(trajectories):
        steps = trajectory.steps if isinstance(trajectory, StepWiseTrajectory) else [trajectory]
        failure = next((step.failure for step in steps if step.failure is not None), None)
        if failure is not None:
            rollout = _rollout_of(trajectory.trajectory_id, position, index_of, samples)
            failures[rollout] = f"{failure.error_type}: {failure.message}"
    return failures


def _injected_failure(firings: Sequence[FaultFiring], rollout: int) -> str | None:
    """What the last fault that broke a call of ``rollout`` did (``step raised ConnectionError: ...``)."""
    hits = [f for f in firings if f.rollout == rollout and f.kind in _FAILING_KINDS]
    if not hits:
        return None
    last = max(hits, key=lambda f: (f.attempt or 0, f.at_s))
    return f"{last.detail} (fault {last.fault})"


async def run_scenarios(
    scenarios: Sequence[CompiledScenario],
    *,
    device: Literal["cpu", "cuda"] = "cpu",
    fail_fast: bool = False,
    on_start: Callable[[CompiledScenario], None] | None = None,
    on_finish: Callable[[ScenarioResult], None] | None = None,
) -> list[ScenarioResult]:
    """Run scenarios in order on one shared ``Bench``; the engines are shut down at the end.

    With ``fail_fast`` the run stops after the first scenario that did not hold.
    """
    bench = Bench(device=device)
    results: list[ScenarioResult] = []
    try:
        for scenario in scenarios:
            if on_start is not None:
                on_start(scenario)
            result = await run_scenario(scenario, bench)
            results.append(result)
            if on_finish is not None:
                on_finish(result)
            if fail_fast and result.status != "held":
                break
    finally:
        await bench.aclose()
    return results
