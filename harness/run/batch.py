"""One run of a scenario's batch, fault-free or faulted, on the scenario's engine.

Decoding is greedy in both runs, so a successful trajectory of the faulted run must equal the
baseline's token for token. Everything the scenario names was resolved when it was compiled: the
runner configuration, the exception classes, the user's env factory, tasks and pipeline, the model
folder. Faults reach the user's parts as they reach the bundled ones: the env factory (bundled or the
user's) is wrapped in the fault injector and the env ledger, the engine in the engine fault injector,
and a user pipeline is handed both. A scenario that declares a ``cluster`` runs both its runs on a local
multi-node Ray cluster started for it alone (``harness.run.clustered``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any, Final

from gym_resilience import (
    AnyTrajectory,
    AttemptRecord,
    BatchOutput,
    BatchRunner,
    RunnerConfig,
    Task,
    build_batch_output,
    describe_exception,
    rollout_headers,
)
from gym_resilience.engines import Engine
from gym_resilience.envs import ToolServer
from gym_resilience.task_gen import tool_env_factory, word_game_factory
from harness.faults.engine import FaultyEngine
from harness.faults.env import FaultyEnvFactory
from harness.faults.nodes import NodeKiller
from harness.faults.plan import FaultPlan
from harness.faults.proxy import FaultProxy
from harness.run.bench import Bench
from harness.run.clustered import cluster_for, placed
from harness.run.endpoints import EndpointWatch
from harness.run.ledger import LedgeredFactory
from harness.run.outcome import ClusterNode, RolloutEnds, RunOutcome
from harness.run.recorder import Recorder
from harness.scenario.compile import CompiledScenario

if TYPE_CHECKING:
    from harness.run.cluster import LocalCluster

__all__ = ["SETTLE_S", "RunOutcome", "ends_the_chaos_run", "run_batch", "run_both"]

SETTLE_S: Final = 10.0
"""How long, at most, the counts of actors and envs left after a run on a cluster wait for killed actors
to die (Ray kills asynchronously, and a killed actor's process exits after it is marked dead); a leaked
actor or env is still there past it."""


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


def ends_the_chaos_run(error: BaseException | None, interrupts: bool) -> bool:
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


def _normalise(
    produced: Any, scenario: CompiledScenario
) -> tuple[list[AnyTrajectory] | None, BatchOutput, RolloutEnds]:
    trajectories = None if isinstance(produced, BatchOutput) else list(produced)
    output = produced if trajectories is None else build_batch_output(trajectories)
    # A pipeline's rollouts have no index from a runner: one per task, by the task's index.
    ends = RolloutEnds.of_pipeline(trajectories or [], output, scenario.index_of, samples=1)
    return trajectories, output, ends


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
    cluster: LocalCluster | None = None,
) -> RunOutcome:
    """Run the scenario's batch once, with or without its faults; never raises what the batch raised.

    ``cluster`` is the scenario's Ray cluster, whose nodes ``kill_node`` faults remove. What the run's
    injectors and envs report goes to one :class:`Recorder`, whose recording the outcome carries.
    """
    with Recorder() as recorder:
        return await _run_recorded(
            scenario, bench, recorder, config=config, with_faults=with_faults, cluster=cluster
        )


async def _run_recorded(
    scenario: CompiledScenario,
    bench: Bench,
    recorder: Recorder,
    *,
    config: RunnerConfig,
    with_faults: bool,
    cluster: LocalCluster | None,
) -> RunOutcome:
    plan = FaultPlan(
        scenario.faults if with_faults else [],
        seed=scenario.spec.seed,
        events=recorder,
        exceptions=scenario.exceptions if with_faults else None,
    )
    tasks = list(scenario.tasks)
    interrupts = with_faults and scenario.interrupts
    ends = RolloutEnds()
    with contextlib.ExitStack() as stack:
        tool_url = None
        if scenario.spec.batch.env == "tool_use":
            tool_url = stack.enter_context(ToolServer()).url
            tool_faults = plan.network_faults("tool")
            if tool_faults:
                tool_url = stack.enter_context(FaultProxy(tool_url, tool_faults, plan)).url
        factory = LedgeredFactory(
            FaultyEnvFactory(_base_factory(scenario, tool_url), plan, scenario.index_of, events=recorder),
            recorder,
        )
        async with _engine_for(scenario, bench, stack, plan) as (engine, kill, failovers, watch):
            faulty = FaultyEngine(engine, plan, kill=kill, events=recorder)
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
                stack.enter_context(NodeKiller(plan, recorder, cluster))
            try:
                if scenario.pipeline is not None:
                    with _exits_contained(exits):
                        produced = await scenario.pipeline(tasks, factory, faulty)
                    trajectories, output, ends = _normalise(produced, scenario)
                else:
                    # Closed here: its warm env workers (processes, Ray actors) end with the run.
                    async with BatchRunner(faulty, factory, config) as runner:
                        result = await runner.generate(tasks)
                    trajectories, output, metrics = result.trajectories, result.output, result.metrics
                    attempts = list(result.attempts)
                    ends = RolloutEnds.of_batch(result)
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
        envs_unclosed = _settled(recorder.envs_unclosed)
        left = set(cluster.worker_node_ids())
        nodes = [ClusterNode(cluster.head_node_id, "head")]
        nodes += [ClusterNode(node, f"worker {i}", node not in left) for i, node in enumerate(workers)]
    return RunOutcome(
        trajectories=trajectories,
        output=output,
        metrics=metrics,
        error=error,
        wall_s=wall_s,
        recording=recorder.recording(envs_unclosed=envs_unclosed),
        ends=ends,
        failovers=moved,
        end_s=end_s,
        endpoints=endpoints,
        actors_alive=actors_alive,
        head_node=cluster.head_node_id if cluster is not None else None,
        attempts=attempts,
        nodes=nodes,
    )


async def run_both(scenario: CompiledScenario, bench: Bench) -> tuple[RunnerConfig, RunOutcome, RunOutcome]:
    """The scenario's fault-free baseline, then its faulted run, with the configuration both ran under.

    Greedy, so the runs can be compared token for token; logprobs, so a numerical tie between two
    tokens can be told from a real difference (``harness.judge.compare``).
    """
    config = dataclasses.replace(scenario.config, temperature=0.0, logprobs=True)
    with cluster_for(scenario) as cluster:
        runs = {
            with_faults: await run_batch(
                scenario,
                bench,
                config=placed(config, scenario, cluster),
                with_faults=with_faults,
                cluster=cluster,
            )
            for with_faults in (False, True)
        }
    return config, runs[False], runs[True]
