"""Replays a scenario: a fault-free baseline and a faulted run on the same engine, then the probes.

Decoding is greedy in both runs, so a successful trajectory of the faulted run must equal the
baseline's token for token. Engines are shared across the scenarios of a run (``Bench``): starting
vLLM costs tens of seconds, a scenario a few.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import sys
import tempfile
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gym_resilience import (
    AnyTrajectory,
    BatchOutput,
    BatchRunner,
    OutputValidationError,
    RunnerConfig,
    Task,
    build_batch_output,
    group_relative_advantages,
    rollout_headers,
    validate_batch_output,
)
from gym_resilience.engines import Engine
from gym_resilience.envs import ToolServer
from gym_resilience.task_gen import generate_tasks, tool_env_factory, word_game_factory
from harness.compare import Comparison, compare_outputs
from harness.faults import (
    FaultPlan,
    FaultyEngine,
    FaultyEnvFactory,
    SpanLog,
    build_rollout_spans,
    read_firings,
)
from harness.ledger import EnvLedger
from harness.loader import resolve_exception, runner_config
from harness.proxy import FaultProxy
from harness.results import FaultFiring, ProbeResult, ScenarioResult
from harness.spec import EngineSpec, NetworkFault, Scenario

__all__ = ["Bench", "RunOutcome", "observe", "run_scenario"]

Pipeline = Callable[[list[Task], Callable[[Task], Any], Engine], Awaitable[Any]]


@dataclass
class _Served:
    servers: list[Any]
    model_dir: Path

    def kill(self, index: int) -> None:
        self.servers[index].kill()

    async def revive(self) -> None:
        for server in self.servers:
            if not server.is_running:
                server.start()
        for server in self.servers:
            await server.wait_healthy()


@dataclass
class Bench:
    """The engines a run shares: one in-process vLLM engine, and served vLLM servers by count.

    A killed server is started again when the next scenario needs it.
    """

    device: Literal["cpu", "cuda"] = "cpu"
    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    _local: Engine | None = None
    _served: dict[int, _Served] = field(default_factory=dict)
    _model_dir: Path | None = None

    def model_dir(self) -> Path:
        if self._model_dir is None:
            from gym_resilience.models import build_tiny_model

            self._model_dir = build_tiny_model()
        return self._model_dir

    async def local(self, spec: EngineSpec) -> Engine:
        if self._local is None:
            from gym_resilience.engines.vllm import VLLMEngine

            engine = VLLMEngine(self.model_dir(), device=self.device, max_model_len=spec.max_model_len)
            self._local = await self._stack.enter_async_context(engine)
        return self._local

    async def served(self, spec: EngineSpec) -> _Served:
        if spec.servers not in self._served:
            from gym_resilience.engines.servers import aservers

            pool = await self._stack.enter_async_context(
                aservers(spec.servers, self.model_dir(), device=self.device, max_model_len=spec.max_model_len)
            )
            self._served[spec.servers] = _Served(list(pool), self.model_dir())
        served = self._served[spec.servers]
        await served.revive()
        return served

    async def aclose(self) -> None:
        await self._stack.aclose()


@dataclass
class RunOutcome:
    """One run of a scenario's batch: what it produced or raised, and what it left behind."""

    trajectories: list[AnyTrajectory] | None
    output: BatchOutput | None
    metrics: dict[str, float]
    error: BaseException | None
    wall_s: float
    envs_unclosed: int
    firings: list[Any] = field(default_factory=list)
    spans: list[Any] = field(default_factory=list)
    failovers: int = 0
    end_s: float | None = None


def _base_factory(scenario: Scenario, tool_url: str | None) -> Callable[[Task], Any]:
    if scenario.batch.env == "tool_use" and tool_url is not None:
        return tool_env_factory(tool_url)
    return word_game_factory


def _load_pipeline(scenario: Scenario, folder: Path) -> Pipeline:
    module_name, _, function = (scenario.pipeline or "").partition(":")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return getattr(importlib.import_module(module_name), function)  # type: ignore[no-any-return]


def _normalise(produced: Any) -> tuple[list[AnyTrajectory] | None, BatchOutput]:
    if isinstance(produced, BatchOutput):
        return None, produced
    trajectories = list(produced)
    return trajectories, build_batch_output(trajectories)


@contextlib.asynccontextmanager
async def _engine_for(
    scenario: Scenario, bench: Bench, proxies: contextlib.ExitStack, with_faults: bool, plan: FaultPlan
) -> AsyncIterator[tuple[Engine, Callable[[int], None] | None, Callable[[], int]]]:
    """The scenario's engine for one run: in-process, or an OpenAIEngine over the served endpoints
    (through fault proxies when a network fault targets the engine link)."""
    if scenario.engine.kind == "vllm":
        yield await bench.local(scenario.engine), None, lambda: 0
        return
    from gym_resilience.engines.openai import OpenAIEngine

    served = await bench.served(scenario.engine)
    urls = [server.url for server in served.servers]
    faults = _network_faults(scenario, "engine") if with_faults else []
    if faults:
        urls = [
            proxies.enter_context(
                FaultProxy(url, [(i, f) for i, f in faults if f.endpoint in (None, endpoint)], plan)
            ).url
            for endpoint, url in enumerate(urls)
        ]
    async with OpenAIEngine(urls, tokenizer_dir=served.model_dir, headers=rollout_headers) as engine:
        yield engine, served.kill, lambda: engine.stats.failovers


def _network_faults(scenario: Scenario, link: str) -> list[tuple[int, NetworkFault]]:
    return [
        (index, fault)
        for index, fault in enumerate(scenario.faults)
        if isinstance(fault, NetworkFault) and fault.link == link
    ]


async def run_batch(
    scenario: Scenario,
    folder: Path,
    bench: Bench,
    *,
    tasks: list[Task],
    config: RunnerConfig,
    with_faults: bool,
    workdir: Path,
) -> RunOutcome:
    """Run the scenario's batch once, with or without its faults; never raises what the batch raised."""
    label = "faulted" if with_faults else "baseline"
    plan = FaultPlan(
        list(scenario.faults) if with_faults else [],
        seed=scenario.seed,
        log_path=workdir / f"{label}-firings.jsonl",
        start=time.time(),
    )
    spans = SpanLog(workdir / f"{label}-spans.jsonl", start=plan.start)
    ledger = EnvLedger(workdir / f"{label}-envs.jsonl")
    index_of = {task.instance_id: index for index, task in enumerate(tasks)}
    interrupts = with_faults and any(getattr(f, "kind", "") == "interrupt" for f in scenario.faults)
    with contextlib.ExitStack() as stack:
        tool_url = None
        if scenario.batch.env == "tool_use":
            tool_url = stack.enter_context(ToolServer()).url
            tool_faults = _network_faults(scenario, "tool") if with_faults else []
            if tool_faults:
                tool_url = stack.enter_context(FaultProxy(tool_url, tool_faults, plan)).url
        factory = ledger.factory(FaultyEnvFactory(_base_factory(scenario, tool_url), plan, index_of, spans))
        async with _engine_for(scenario, bench, stack, with_faults, plan) as (engine, kill, failovers):
            faulty = FaultyEngine(engine, plan, kill=kill, spans=spans)
            before = failovers()
            start = time.perf_counter()
            trajectories: list[AnyTrajectory] | None = None
            output: BatchOutput | None = None
            metrics: dict[str, float] = {}
            error: BaseException | None = None
            try:
                if scenario.pipeline:
                    produced = await _load_pipeline(scenario, folder)(tasks, factory, faulty)
                    trajectories, output = _normalise(produced)
                else:
                    result = await BatchRunner(faulty, factory, config).generate(tasks)
                    trajectories, output, metrics = result.trajectories, result.output, result.metrics
            except (KeyboardInterrupt, Exception) as exc:
                if isinstance(exc, KeyboardInterrupt) and not interrupts:
                    raise
                error = exc
            wall_s = time.perf_counter() - start
            end_s = time.time() - plan.start
            moved = failovers() - before
    return RunOutcome(
        trajectories=trajectories,
        output=output,
        metrics=metrics,
        error=error,
        wall_s=wall_s,
        envs_unclosed=ledger.unclosed(),
        firings=read_firings(plan.log_path),
        spans=spans.read(),
        failovers=moved,
        end_s=end_s,
    )


def _placeholder_count(outcome: RunOutcome) -> int | None:
    if outcome.output is None:
        return None
    return sum(1 for flag in outcome.output.is_placeholder if flag)


def _validator_passes(output: BatchOutput | None, num_prompts: int, step_wise: bool) -> bool:
    if output is None:
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            validate_batch_output(output, num_prompts, step_wise=step_wise)
    except OutputValidationError:
        return False
    return True


def _logprobs_per_token(output: BatchOutput | None) -> bool:
    if output is None or output.rollout_logprobs is None:
        return False
    return all(
        len(lps) == len(ids) and all(math.isfinite(lp) and lp <= 0 for lp in lps)
        for lps, ids in zip(output.rollout_logprobs, output.response_ids, strict=True)
    )


def _latency_per_rollout(scenario: Scenario, firings: Sequence[FaultFiring]) -> float | None:
    """The most network latency the faults injected into one rollout's requests, which run one after
    another (each delayed request waited at least ``latency_s``); None when no latency hit a rollout."""
    totals: dict[int, float] = {}
    for firing in firings:
        fault = scenario.faults[firing.fault]
        if isinstance(fault, NetworkFault) and fault.kind == "latency" and firing.rollout is not None:
            totals[firing.rollout] = totals.get(firing.rollout, 0.0) + fault.latency_s
    return max(totals.values(), default=None)


def observe(
    scenario: Scenario,
    baseline: RunOutcome,
    faulted: RunOutcome,
    *,
    num_prompts: int,
    step_wise: bool,
    comparison: Comparison,
) -> dict[str, Any]:
    """Every probe's observation of one scenario (None where a probe has nothing to observe)."""
    output = faulted.output
    latency = _latency_per_rollout(scenario, faulted.firings)
    masked = None
    if output is not None and not step_wise:
        masked = len(group_relative_advantages(output, failed_group_policy="mask_group").masked_groups)
    observations: dict[str, Any] = {
        "batch_size": len(output) if output is not None else None,
        "validator_passes": _validator_passes(output, num_prompts, step_wise),
        "failed": _placeholder_count(faulted),
        "placeholders": _placeholder_count(faulted),
        "envs_unclosed": baseline.envs_unclosed + faulted.envs_unclosed,
        "identical_to_baseline": comparison.identical,
        "numerical_ties": len(comparison.ties) if comparison.identical is not None else None,
        "error_type": type(faulted.error).__name__ if faulted.error is not None else "none",
        "wall_time_ratio": faulted.wall_s / baseline.wall_s if baseline.wall_s > 0 else None,
        "wall_over_injected_latency": faulted.wall_s / latency if latency else None,
        "retries": faulted.metrics.get("retries", 0.0),
        "retries_succeeded": faulted.metrics.get("retries/succeeded", 0.0),
        "failovers": faulted.failovers,
        "faults_fired": len(faulted.firings),
        "masked_groups": masked,
        "token_level_rewards": output is not None and all(isinstance(r, list) for r in output.rewards),
        "logprobs_per_token": _logprobs_per_token(output),
    }
    for key, value in faulted.metrics.items():
        observations[f"metrics.{key}"] = value
    return observations


def _outcome_probe(scenario: Scenario, faulted: RunOutcome) -> ProbeResult:
    expect = scenario.expect
    observed = "completes" if faulted.error is None else f"raises {type(faulted.error).__name__}"
    if expect.outcome == "completes":
        return ProbeResult("outcome", "completes", observed, faulted.error is None)
    expected_type = resolve_exception(expect.error or "")
    held = faulted.error is not None and isinstance(faulted.error, expected_type)
    return ProbeResult("outcome", f"raises {expect.error}", observed, held)


async def run_scenario(path: Path, scenario: Scenario, bench: Bench) -> ScenarioResult:
    """Run one scenario (baseline, then faulted) and judge it; harness failures become status 'error'."""
    result = ScenarioResult(file=str(path), title=scenario.title, status="error")
    result.spec = scenario.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    try:
        # Greedy, so the runs can be compared token for token; logprobs, so a numerical tie between
        # two tokens can be told from a real difference (harness.compare).
        config = dataclasses.replace(runner_config(scenario), temperature=0.0, logprobs=True)
        seed = scenario.batch.seed if scenario.batch.seed is not None else scenario.seed
        tasks = generate_tasks(scenario.batch.tasks, seed=seed, env=scenario.batch.env)
        with tempfile.TemporaryDirectory(prefix="gym-resilience-chaos-") as tmp:
            runs = {}
            for with_faults in (False, True):
                runs[with_faults] = await run_batch(
                    scenario,
                    path.parent,
                    bench,
                    tasks=tasks,
                    config=config,
                    with_faults=with_faults,
                    workdir=Path(tmp),
                )
        baseline, faulted = runs[False], runs[True]
        comparison = compare_outputs(baseline.output, faulted.output)
        observations = observe(
            scenario,
            baseline,
            faulted,
            num_prompts=len(tasks) * config.n_samples_per_prompt,
            step_wise=config.step_wise,
            comparison=comparison,
        )
        details = {"identical_to_baseline": comparison.describe(), "numerical_ties": comparison.describe()}
        probes = [_outcome_probe(scenario, faulted)]
        probes += [
            ProbeResult(
                p.probe,
                p.describe(),
                observations.get(p.probe),
                p.holds(observations.get(p.probe)),
                details.get(p.probe, ""),
            )
            for p in scenario.probes
        ]
        result.probes = probes
        result.firings = faulted.firings
        result.rollouts = build_rollout_spans(
            faulted.spans, len(tasks) * config.n_samples_per_prompt, until_s=faulted.end_s
        )
        _mark_placeholders(result, faulted)
        result.outcome = probes[0].observed
        result.baseline_s, result.faulted_s = baseline.wall_s, faulted.wall_s
        result.status = "held" if all(p.held for p in probes) else "deviated"
        if baseline.error is not None:
            result.message = (
                f"the fault-free baseline failed: {type(baseline.error).__name__}: {baseline.error}"
            )
            result.status = "error"
    except Exception as exc:
        result.status = "error"
        result.message = f"{type(exc).__name__}: {exc}"
    return result


def _mark_placeholders(result: ScenarioResult, faulted: RunOutcome) -> None:
    if faulted.trajectories is None:
        return
    for span, trajectory in zip(result.rollouts, faulted.trajectories, strict=False):
        span.placeholder = trajectory.is_placeholder
        failure = getattr(trajectory, "failure", None)
        if failure is not None:
            span.error = f"{failure.error_type}: {failure.message}"


async def run_scenarios(
    scenarios: Sequence[tuple[Path, Scenario]],
    *,
    device: Literal["cpu", "cuda"] = "cpu",
    on_start: Callable[[Path, Scenario], None] | None = None,
    on_finish: Callable[[ScenarioResult], None] | None = None,
) -> list[ScenarioResult]:
    """Run scenarios in order on one shared ``Bench``; the engines are shut down at the end."""
    bench = Bench(device=device)
    results: list[ScenarioResult] = []
    try:
        for path, scenario in scenarios:
            if on_start is not None:
                on_start(path, scenario)
            result = await run_scenario(path, scenario, bench)
            results.append(result)
            if on_finish is not None:
                on_finish(result)
    finally:
        await bench.aclose()
    return results
