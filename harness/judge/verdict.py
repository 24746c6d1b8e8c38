"""The verdict on a scenario: its two runs judged by its probes and expected outcome, into the one
``ScenarioResult`` every report reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from gym_resilience import RunnerConfig, describe_exception, root_cause
from harness.faults.events import FaultFiring
from harness.judge.compare import compare_outputs
from harness.judge.probes import Runs, observations
from harness.judge.results import ProbeResult, ScenarioResult
from harness.judge.rollouts import attempt_records, rollout_records
from harness.run.batch import ends_the_chaos_run, run_both
from harness.run.bench import Bench
from harness.run.outcome import RunOutcome
from harness.scenario.compile import CompiledScenario
from harness.scenario.spec import EnvFault, NetworkFault

__all__ = ["judge", "run_scenario", "run_scenarios"]


def _latency_per_rollout(scenario: CompiledScenario, firings: Sequence[FaultFiring]) -> float | None:
    """The most network latency the faults injected into one rollout's requests, which run one after
    another (each delayed request waited at least ``latency_s``); None when no latency hit a rollout."""
    totals: dict[int, float] = {}
    for firing in firings:
        fault = scenario.faults[firing.fault]
        latency = getattr(fault, "latency_s", None)
        if isinstance(fault, NetworkFault) and latency is not None and firing.rollout is not None:
            totals[firing.rollout] = totals.get(firing.rollout, 0.0) + latency
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


def judge(
    scenario: CompiledScenario, config: RunnerConfig, baseline: RunOutcome, faulted: RunOutcome
) -> ScenarioResult:
    """The result of a scenario's two runs: probes, firings, each rollout's calls and fate, status.

    Every report reads this one result, so the journal, JUnit and the timelines cannot disagree.
    """
    result = ScenarioResult(file=str(scenario.file), title=scenario.title, status="error")
    result.spec = _spec_as_run(scenario)
    samples = scenario.rollouts_per_task(config)
    n_rollouts = len(scenario.tasks) * samples
    comparison = compare_outputs(baseline.output, faulted.output)
    observed = observations(
        Runs(
            baseline=baseline,
            faulted=faulted,
            comparison=comparison,
            num_prompts=len(scenario.tasks) * config.n_samples_per_prompt,
            step_wise=config.step_wise,
            injected_latency_s=_latency_per_rollout(scenario, faulted.recording.firings),
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
    result.probes = probes
    result.firings = faulted.recording.firings
    result.rollouts = rollout_records(faulted, n_rollouts)
    result.baseline_rollouts = rollout_records(baseline, n_rollouts)
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
    ``ends_the_chaos_run``); None when neither did."""
    interrupts = scenario.interrupts
    for run, error, allowed in (
        ("fault-free baseline", baseline.error, False),
        ("faulted run", faulted.error, interrupts),
    ):
        if error is not None and ends_the_chaos_run(error, allowed):
            return (
                f"the {run} raised {describe_exception(error)} in the scenario's env or pipeline: a "
                "BaseException that is not an Exception (sys.exit(), asyncio.CancelledError) would end "
                "the whole chaos run, so it is this scenario's error; raise an Exception instead"
            )
    return None


def _env_faults_unreachable(scenario: CompiledScenario, faulted: RunOutcome) -> bool:
    env_faults = {index for index, fault in enumerate(scenario.faults) if isinstance(fault, EnvFault)}
    fired = any(firing.fault in env_faults for firing in faulted.recording.firings)
    return (
        scenario.pipeline is not None
        and bool(env_faults)
        and not fired
        and faulted.recording.envs_created == 0
    )


async def run_scenario(scenario: CompiledScenario, bench: Bench) -> ScenarioResult:
    """Run one scenario (baseline, then faulted) and judge it; harness failures become status 'error'."""
    try:
        config, baseline, faulted = await run_both(scenario, bench)
        return judge(scenario, config, baseline, faulted)
    except Exception as exc:
        result = ScenarioResult(file=str(scenario.file), title=scenario.title, status="error")
        result.spec = _spec_as_run(scenario)
        result.message = describe_exception(root_cause(exc))
        return result


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
