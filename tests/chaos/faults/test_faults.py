"""Fault injection: the plan's decisions, its shared log, and the env and engine wrappers in real batches."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from doubles import EnvCounts, factory, tasks

from gym_resilience import (
    BatchRunner,
    EnvStepError,
    RetryPolicy,
    RunnerConfig,
    Trajectory,
    UnsupportedConfigError,
)
from gym_resilience.engines.base import Generation, Sampling
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.rollout.progress import _CURRENT, Progress
from gym_resilience.task_gen import generate_tasks, word_game_factory
from gym_resilience.tasks import Task
from gym_resilience.testing import ScriptableEnv
from gym_resilience.trajectories import without_timings
from harness.faults import (
    BAD_RESET_OBSERVATION,
    BAD_REWARD,
    BAD_STEP_OBSERVATION,
    HANG_S,
    FaultPlan,
    FaultyEngine,
    FaultyEnv,
    FaultyEnvFactory,
)
from harness.judge.results import FaultFiring
from harness.judge.rollouts import build_rollout_spans
from harness.run.recorder import Recorder
from harness.scenario.names import resolve_exception
from harness.scenario.spec import EngineFault, EnvFault, Fault, Targeting

ROOT = Path(__file__).resolve().parents[3]


def env_fault(kind: str = "raise", method: str = "step", **options: Any) -> EnvFault:
    when = Targeting(**options.pop("when", {}))
    return EnvFault(target="env", kind=kind, method=method, when=when, **options)  # type: ignore[arg-type]


def engine_fault(kind: str = "raise", **options: Any) -> EngineFault:
    when = Targeting(**options.pop("when", {}))
    return EngineFault(target="engine", kind=kind, when=when, **options)  # type: ignore[arg-type]


def make_plan(tmp_path: Path, *faults: Fault, seed: int = 0) -> FaultPlan:
    """A plan with each raise fault's class resolved, as a compiled scenario hands them over."""
    exceptions = {
        index: resolve_exception(fault.exception)
        for index, fault in enumerate(faults)
        if isinstance(fault, EnvFault | EngineFault) and fault.kind == "raise"
    }
    return FaultPlan(list(faults), seed=seed, events=Recorder(tmp_path), exceptions=exceptions)


def recorder(plan: FaultPlan) -> Recorder:
    """The recorder ``make_plan`` gave the plan: what its firings and the spans given it were reported to."""
    assert isinstance(plan.events, Recorder)
    return plan.events


def firings_of(plan: FaultPlan) -> list[FaultFiring]:
    return recorder(plan).firings()


async def run_batch(
    plan: FaultPlan | None,
    config: RunnerConfig,
    *,
    n: int = 4,
    ledger: EnvCounts | None = None,
    engine: Any = None,
    events: Recorder | None = None,
) -> Any:
    batch = tasks(n)
    env_factory = FaultyEnvFactory(
        factory(ledger or EnvCounts()), plan, {t.instance_id: i for i, t in enumerate(batch)}, events=events
    )
    return await BatchRunner(engine or ScriptedEngine(), env_factory, config).generate(batch)


def no_sleep(seconds: float) -> None:
    SLEPT.append(seconds)


SLEPT: list[float] = []


# --- The plan's decisions. --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("when", "where", "fires"),
    [
        ({}, (0, 0, 0), True),
        ({}, (None, None, None), True),
        ({"rollouts": [1, 3]}, (3, 0, 0), True),
        ({"rollouts": [1, 3]}, (2, 0, 0), False),
        ({"rollouts": [1]}, (None, 0, 0), False),
        ({"turns": [2]}, (0, 0, 2), True),
        ({"turns": [2]}, (0, 0, 1), False),
        ({"turns": [0]}, (0, 0, None), False),
        ({"attempts": [0]}, (5, 0, 1), True),
        ({"attempts": [0]}, (5, 1, 1), False),
        ({"rollouts": [1], "turns": [2], "attempts": [1]}, (1, 1, 2), True),
        ({"rollouts": [1], "turns": [2], "attempts": [1]}, (1, 0, 2), False),
        ({"rollouts": [1], "turns": [2], "attempts": [1]}, (0, 1, 2), False),
        ({"probability": 1.0}, (0, 0, 0), True),
        ({"probability": 0.0}, (0, 0, 0), False),
        ({"rollouts": [1], "probability": 1.0}, (0, 0, 0), False),
    ],
)
def test_targeting_filters_all_have_to_match_for_a_fault_to_fire(
    tmp_path: Path, when: dict[str, Any], where: tuple[int | None, ...], fires: bool
) -> None:
    plan = make_plan(tmp_path, env_fault(when=when))
    rollout, attempt, turn = where
    assert plan.fires(0, rollout=rollout, attempt=attempt, turn=turn) is fires


def test_nth_call_counts_per_fault_only_the_calls_that_passed_the_other_filters(tmp_path: Path) -> None:
    plan = make_plan(
        tmp_path,
        env_fault(when={"turns": [1], "nth_call": [1, 2]}),
        env_fault(when={"nth_call": [0]}),
    )
    turns = [0, 1, 0, 1, 1, 1, 0]
    first = [plan.fires(0, rollout=0, attempt=0, turn=t) for t in turns]
    second = [plan.fires(1, rollout=0, attempt=0, turn=t) for t in turns]
    # Calls with turn 1 are the fault's calls 0, 1, 2, 3: the 2nd and 3rd of them fire.
    assert first == [False, False, False, True, True, False, False]
    assert second == [True, False, False, False, False, False, False]


def test_probability_replays_with_the_same_seed_and_changes_with_another(tmp_path: Path) -> None:
    fault = env_fault(when={"probability": 0.5})
    grid = [(rollout, attempt, turn) for rollout in range(8) for attempt in range(2) for turn in range(8)]

    def decisions(seed: int) -> list[bool]:
        plan = make_plan(tmp_path, fault, seed=seed)
        return [plan.fires(0, rollout=r, attempt=a, turn=t) for r, a, t in reversed(grid)][::-1]

    first, again, other = decisions(7), decisions(7), decisions(8)
    assert first == again
    assert first != other
    assert 0.35 < sum(first) / len(first) < 0.65


def test_probability_draws_differ_per_fault_index(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, env_fault(when={"probability": 0.5}), env_fault(when={"probability": 0.5}))
    grid = [(r, t) for r in range(10) for t in range(10)]
    first = [plan.fires(0, rollout=r, attempt=0, turn=t) for r, t in grid]
    second = [plan.fires(1, rollout=r, attempt=0, turn=t) for r, t in grid]
    assert first != second


def test_a_plan_pickles_and_its_copy_counts_nth_calls_afresh(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, env_fault(when={"nth_call": [0]}))
    assert plan.fires(0, rollout=0, attempt=0, turn=0)
    copy = pickle.loads(pickle.dumps(plan))
    assert not plan.fires(0, rollout=0, attempt=0, turn=0)
    assert copy.fires(0, rollout=0, attempt=0, turn=0)
    assert copy.events == recorder(plan).channel and copy.faults == plan.faults


def test_a_raise_fault_without_its_exception_class_is_refused_when_the_plan_is_built(tmp_path: Path) -> None:
    faults = [env_fault("delay"), engine_fault(exception="TimeoutError")]
    with pytest.raises(UnsupportedConfigError) as info:
        FaultPlan(faults, seed=0, exceptions={})
    assert info.value.option == "faults[1].exception"
    assert str(info.value) == (
        "faults[1].exception: no exception class for the raise fault 'TimeoutError': give the classes the "
        "scenario was compiled with (CompiledScenario.exceptions)"
    )


def test_a_raise_fault_raises_the_class_it_was_given_without_resolving_its_name(tmp_path: Path) -> None:
    class SandboxGone(Exception):
        pass

    fault = env_fault(exception="NotAName", message="sandbox gone")
    plan = FaultPlan([fault], seed=0, exceptions={0: SandboxGone})
    error = plan.exception(0)
    assert type(error) is SandboxGone
    assert str(error) == "sandbox gone"
    assert error.__notes__ == ["injected by chaos fault 0"]


# --- The recorder: firings and spans from threads and worker processes. -----------------------------------

_WORKER = """
import pickle, sys
from gym_resilience.tasks import Task
env_factory = pickle.loads(open(sys.argv[1], "rb").read())
task = Task(prompt=[{"role": "user", "content": "guess"}], instance_id="w", env_kwargs={"secret": "cab"})
env = env_factory(task)
env.reset(options={"task": task, "rollout_index": 5, "attempt": 1})
env.step("a")
try:
    env.step("b")
except ConnectionResetError as error:
    print("raised", error)
env.close()
"""


@pytest.mark.slow
def test_firings_from_two_threads_and_a_worker_process_all_reach_the_recorder_in_order(
    tmp_path: Path,
) -> None:
    plan = make_plan(
        tmp_path, env_fault(exception="ConnectionResetError", message="gone", when={"turns": [1]})
    )
    spans = recorder(plan)
    pickled = tmp_path / "factory.pickle"
    pickled.write_bytes(pickle.dumps(FaultyEnvFactory(word_game_factory, plan, events=spans)))

    def log_many(rollout: int) -> None:
        for turn in range(200):
            plan.record(0, rollout=rollout, attempt=0, turn=turn, detail="thread")

    threads = [threading.Thread(target=log_many, args=(rollout,)) for rollout in (1, 2)]
    for thread in threads:
        thread.start()
    worker = subprocess.run(
        [sys.executable, "-c", _WORKER, str(pickled)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    for thread in threads:
        thread.join()
    assert worker.returncode == 0, worker.stderr
    assert worker.stdout == "raised gone\n"
    firings = firings_of(plan)
    assert len(firings) == 401
    assert [(f.rollout, f.turn) for f in firings[:400]] == [(r, t) for r in (1, 2) for t in range(200)]
    assert firings[-1] == FaultFiring(
        fault=0,
        kind="raise",
        target="env",
        rollout=5,
        attempt=1,
        turn=1,
        detail="step raised ConnectionResetError: gone",
        at_s=firings[-1].at_s,
    )
    assert 0 < firings[-1].at_s < 60
    timeline = build_rollout_spans(spans.spans(), 6)[5].spans
    assert [(s.kind, s.turn, s.attempt, s.failed) for s in timeline] == [
        ("reset", None, 1, False),
        ("step", 0, 1, False),
        ("step", 1, 1, True),
        ("close", 1, 1, False),
    ]


@pytest.mark.slow
async def test_isolated_env_workers_take_the_rollout_from_reset_options_and_a_hang_dies_at_the_deadline(
    tmp_path: Path,
) -> None:
    plan = make_plan(
        tmp_path,
        env_fault(exception="ConnectionResetError", when={"rollouts": [1], "turns": [0]}),
        env_fault("hang", when={"rollouts": [2], "turns": [1]}),
    )
    spans = recorder(plan)
    batch = generate_tasks(3, seed=0)
    env_factory = FaultyEnvFactory(word_game_factory, plan, {}, spans)  # no fallback: options must say
    config = RunnerConfig(skip_failed_rollouts=True, isolate_envs=True, max_turns=3, env_step_timeout_s=0.5)
    result = await BatchRunner(ScriptedEngine(), env_factory, config).generate(batch)
    failures = {f.rollout_index: f for f in result.failures}
    assert sorted(failures) == [1, 2]
    assert isinstance(failures[1].exception.__cause__, ConnectionResetError)
    assert isinstance(failures[2].exception, TimeoutError) and failures[2].turn == 1
    assert [(f.rollout, f.attempt, f.turn, f.detail) for f in firings_of(plan)] == [
        (1, 0, 0, "step raised ConnectionResetError: injected fault"),
        (2, 0, 1, "step hung"),
    ]
    hung = build_rollout_spans(spans.spans(), 3, until_s=time.time() - plan.start)[2].spans
    assert [(s.kind, s.turn, s.failed) for s in hung] == [
        ("reset", None, False),
        ("step", 0, False),
        ("step", 1, True),
    ]
    assert hung[-1].end_s - hung[-1].start_s >= 0.5


def test_a_recorder_that_was_never_reported_to_has_an_empty_recording(tmp_path: Path) -> None:
    with Recorder(tmp_path) as empty:
        assert (empty.firings(), empty.spans(), empty.envs_created(), empty.envs_unclosed()) == ([], [], 0, 0)
    assert list(tmp_path.iterdir()) == []  # its channel file is gone with it


# --- FaultyEnv in real batches. -------------------------------------------------------------------------


async def test_an_env_raise_fault_fails_the_targeted_rollout_at_its_turn_and_only_it(tmp_path: Path) -> None:
    plan = make_plan(
        tmp_path, env_fault(exception="ConnectionResetError", when={"rollouts": [1], "turns": [1]})
    )
    ledger = EnvCounts()
    result = await run_batch(plan, RunnerConfig(skip_failed_rollouts=True, max_turns=3), ledger=ledger)
    [failure] = result.failures
    assert (failure.rollout_index, failure.phase, failure.turn) == (1, "step", 1)
    assert isinstance(failure.exception, EnvStepError)
    assert isinstance(failure.exception.__cause__, ConnectionResetError)
    assert str(failure.exception.__cause__) == "injected fault"
    assert failure.exception.__cause__.__notes__ == ["injected by chaos fault 0"]
    assert [(f.rollout, f.attempt, f.turn, f.detail) for f in firings_of(plan)] == [
        (1, 0, 1, "step raised ConnectionResetError: injected fault")
    ]
    assert ledger.open == 0


async def test_with_no_fault_firing_a_batch_through_the_wrappers_equals_the_plain_batch(
    tmp_path: Path,
) -> None:
    config = RunnerConfig(max_turns=3, logprobs=True)
    plan = make_plan(tmp_path, env_fault(when={"rollouts": [99]}), engine_fault(when={"rollouts": [99]}))
    plain = await run_batch(None, config)
    wrapped = await run_batch(plan, config, engine=FaultyEngine(ScriptedEngine(), plan))
    assert [without_timings(t) for t in wrapped.trajectories] == [
        without_timings(t) for t in plain.trajectories
    ]
    assert firings_of(plan) == []


async def test_a_fault_on_attempt_zero_only_is_survived_by_a_retry(tmp_path: Path) -> None:
    plan = make_plan(
        tmp_path,
        env_fault(exception="ConnectionResetError", when={"rollouts": [2], "turns": [0], "attempts": [0]}),
    )
    retry = RetryPolicy(attempts=2, initial_delay_s=0.0, max_delay_s=0.0, jitter_s=0.0)
    result = await run_batch(plan, RunnerConfig(skip_failed_rollouts=True, max_turns=2, retry=retry))
    assert result.failures == []
    assert [(f.rollout, f.attempt, f.turn) for f in firings_of(plan)] == [(2, 0, 0)]


async def test_an_interrupt_fault_propagates_keyboard_interrupt_and_every_env_is_closed(
    tmp_path: Path,
) -> None:
    plan = make_plan(tmp_path, env_fault("interrupt", when={"rollouts": [0], "turns": [1]}))
    ledger = EnvCounts()
    with pytest.raises(KeyboardInterrupt, match=r"^injected fault$"):
        await run_batch(
            plan,
            RunnerConfig(skip_failed_rollouts=True, max_turns=3),
            ledger=ledger,
            engine=ScriptedEngine(delay_s=0.01),
        )
    assert ledger.open == 0
    assert [f.detail for f in firings_of(plan)] == ["step interrupted"]


async def test_a_bad_output_reset_is_rejected_by_the_runner_with_a_clear_error(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, env_fault("bad_output", "reset", when={"rollouts": [0]}))
    result = await run_batch(plan, RunnerConfig(skip_failed_rollouts=True, max_turns=2), n=2)
    [failure] = result.failures
    assert (failure.rollout_index, failure.phase) == (0, "reset")
    assert isinstance(failure.exception, TypeError)
    assert str(failure.exception) == "a text env must return chat messages or a string, got int: 12345"


def test_a_bad_output_step_does_the_step_and_returns_wrong_types(tmp_path: Path) -> None:
    inner = ScriptableEnv()
    env = FaultyEnv(inner, make_plan(tmp_path, env_fault("bad_output")), rollout=0)
    assert env.reset() == ("Say something.", {})
    stepped: tuple[Any, ...] = env.step("hi")
    assert stepped == (BAD_STEP_OBSERVATION, BAD_REWARD, False, False, {})
    assert inner.step_calls == 1
    assert BAD_STEP_OBSERVATION.keys().isdisjoint({"role", "content"})
    with pytest.raises(ValueError):
        float(BAD_REWARD)
    assert not isinstance(BAD_RESET_OBSERVATION, str | list | dict)


def test_a_delay_fault_sleeps_then_lets_the_call_through(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, env_fault("delay", "reset", delay_s=0.1))
    env = FaultyEnv(ScriptableEnv(), plan, rollout=3)
    started = time.perf_counter()
    assert env.reset() == ("Say something.", {})
    assert time.perf_counter() - started >= 0.1
    assert [(f.rollout, f.attempt, f.turn, f.detail) for f in firings_of(plan)] == [
        (3, 0, None, "reset delayed 0.1 s")
    ]


def test_a_hang_fault_sleeps_past_any_deadline_and_logs_a_span_that_never_ends(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, env_fault("hang", when={"turns": [0]}))
    spans = recorder(plan)
    SLEPT.clear()
    env = FaultyEnv(ScriptableEnv(), plan, rollout=0, events=spans, sleep=no_sleep)
    env.reset()
    env.step("a")
    assert SLEPT == [HANG_S] and HANG_S >= 3600
    open_spans = [s for s in spans.spans() if s.end_s is None]
    assert [(s.kind, s.turn, s.failed) for s in open_spans] == [("step", 0, True)]
    [timeline] = build_rollout_spans(spans.spans(), 1, until_s=99.0)
    assert [(s.kind, s.end_s) for s in timeline.spans if s.failed] == [("step", 99.0)]


def test_a_close_fault_raises_but_the_inner_env_is_closed_anyway(tmp_path: Path) -> None:
    inner = ScriptableEnv()
    plan = make_plan(tmp_path, env_fault(method="close", exception="OSError", message="disk gone"))
    env = FaultyEnv(inner, plan, rollout=0)
    env.reset()
    env.step("a")
    env.step("b")
    with pytest.raises(OSError) as info:
        env.close()
    assert str(info.value) == "disk gone"
    assert inner.close_calls == 1
    assert [(f.turn, f.detail) for f in firings_of(plan)] == [(1, "close raised OSError: disk gone")]


def test_the_rollout_comes_from_current_rollout_then_reset_options_then_the_fallback(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, env_fault("delay", "reset", delay_s=0.001))
    env = FaultyEnv(ScriptableEnv(), plan, rollout=7)
    env.reset()
    env.reset(options={"rollout_index": 4, "attempt": 2})
    token = _CURRENT.set(Progress(rollout_index=9, attempt=1))
    try:
        env.reset(options={"rollout_index": 4, "attempt": 2})
    finally:
        _CURRENT.reset(token)
    assert [(f.rollout, f.attempt) for f in firings_of(plan)] == [(4, 2), (7, 0), (9, 1)]


def test_the_env_factory_pickles_and_maps_tasks_to_their_batch_index(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, env_fault(when={"rollouts": [1]}))
    batch = generate_tasks(2, seed=0)
    env_factory = pickle.loads(
        pickle.dumps(
            FaultyEnvFactory(word_game_factory, plan, {t.instance_id: i for i, t in enumerate(batch)})
        )
    )
    first, second = env_factory(batch[0]), env_factory(batch[1])
    first.reset(options={"task": batch[0]})
    second.reset(options={"task": batch[1]})
    first.step("e")
    with pytest.raises(RuntimeError) as info:
        second.step("e")
    assert str(info.value) == "injected fault"
    assert isinstance(env_factory(Task(prompt=[], instance_id="elsewhere")), FaultyEnv)


# --- FaultyEngine. --------------------------------------------------------------------------------------


async def test_an_engine_raise_fault_fails_the_targeted_rollout_at_generate(tmp_path: Path) -> None:
    plan = make_plan(
        tmp_path, engine_fault(exception="TimeoutError", message="slow", when={"rollouts": [2], "turns": [1]})
    )
    result = await run_batch(
        plan,
        RunnerConfig(skip_failed_rollouts=True, max_turns=3),
        engine=FaultyEngine(ScriptedEngine(), plan),
    )
    [failure] = result.failures
    assert (failure.rollout_index, failure.phase, failure.turn) == (2, "generate", 1)
    assert type(failure.exception) is TimeoutError and str(failure.exception) == "slow"
    assert [(f.rollout, f.turn, f.detail) for f in firings_of(plan)] == [
        (2, 1, "generate raised TimeoutError: slow")
    ]


async def test_engine_probability_inside_rollouts_does_not_depend_on_request_order(tmp_path: Path) -> None:
    grid = [(rollout, turn) for rollout in range(6) for turn in range(4)]

    async def fired(order: list[tuple[int, int]]) -> set[tuple[int | None, int | None]]:
        plan = make_plan(tmp_path, engine_fault("abort", when={"probability": 0.5}), seed=11)
        engine = FaultyEngine(ScriptedEngine(), plan)
        for rollout, turn in order:
            token = _CURRENT.set(Progress(rollout_index=rollout, turn=turn))
            try:
                await engine.generate([1], Sampling())
            finally:
                _CURRENT.reset(token)
        firings = firings_of(plan)
        return {(f.rollout, f.turn) for f in firings}

    forward, backward = await fired(grid), await fired(grid[::-1])
    assert forward == backward and 0 < len(forward) < len(grid)


async def test_an_engine_delay_fault_delays_generation_then_generates(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, engine_fault("delay", delay_s=0.1))
    inner = ScriptedEngine()
    engine = FaultyEngine(inner, plan)
    started = time.perf_counter()
    generation = await engine.generate([1, 2, 3], Sampling())
    assert time.perf_counter() - started >= 0.1
    assert generation == await inner.generate([1, 2, 3], Sampling())
    assert [(f.rollout, f.turn, f.detail) for f in firings_of(plan)] == [
        (None, None, "generate delayed 0.1 s")
    ]


@pytest.mark.parametrize(("length", "kept"), [(1, 1), (2, 1), (7, 3), (16, 8)])
async def test_an_abort_keeps_half_the_tokens_at_least_one_with_matching_logprobs(
    tmp_path: Path, length: int, kept: int
) -> None:
    def script(prompt_ids: list[int], sampling: Sampling, call: int) -> Generation:
        return Generation(list(range(10, 10 + length)), [-0.25] * length, "stop")

    plan = make_plan(tmp_path, engine_fault("abort"))
    generation = await FaultyEngine(ScriptedEngine(script), plan).generate([1], Sampling(logprobs=True))
    assert generation == Generation(list(range(10, 10 + kept)), [-0.25] * kept, "abort")
    assert [f.detail for f in firings_of(plan)] == [f"generate aborted after {kept} of {length} tokens"]


async def test_an_aborted_turn_ends_its_rollout_with_finish_reason_abort(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, engine_fault("abort", when={"rollouts": [0], "turns": [1]}))
    result = await run_batch(
        plan, RunnerConfig(max_turns=3), n=2, engine=FaultyEngine(ScriptedEngine(), plan)
    )
    first, second = result.trajectories
    assert isinstance(first, Trajectory) and isinstance(second, Trajectory)
    assert (first.stop_reason, second.stop_reason) == ("abort", "stop")


async def test_a_kill_fault_calls_kill_once_when_the_nth_request_starts(tmp_path: Path) -> None:
    killed: list[tuple[int, int]] = []
    inner = ScriptedEngine()
    plan = make_plan(tmp_path, engine_fault("kill", server=1, after_requests=2))
    engine = FaultyEngine(inner, plan, kill=lambda server: killed.append((server, inner.calls)))
    for _ in range(5):
        await engine.generate([1, 2], Sampling())
    assert killed == [(1, 2)]  # before the third request reached the engine
    assert inner.calls == 5 and engine.requests == 5
    assert [(f.kind, f.detail) for f in firings_of(plan)] == [("kill", "killed server 1 at request 2")]


def test_a_kill_fault_without_a_kill_callback_is_rejected(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, engine_fault("delay"), engine_fault("kill"))
    with pytest.raises(UnsupportedConfigError, match=r"^faults\[1\]\.kind: a kill fault needs served engine"):
        FaultyEngine(ScriptedEngine(), plan)


async def test_the_faulty_engine_passes_through_the_tokenizer_and_other_attributes() -> None:
    inner = ScriptedEngine()
    engine = FaultyEngine(inner)
    assert engine.tokenizer is inner.tokenizer
    await engine.generate([1], Sampling())
    assert engine.calls == 1 and engine.delay_s == 0.0


# --- Timelines. -----------------------------------------------------------------------------------------


async def test_spans_give_each_rollout_its_calls_in_order_and_mark_the_failed_one(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, env_fault(exception="ConnectionError", when={"rollouts": [1], "turns": [1]}))
    spans = recorder(plan)
    engine = FaultyEngine(ScriptedEngine(), plan, events=spans)
    await run_batch(
        plan, RunnerConfig(skip_failed_rollouts=True, max_turns=2), n=2, engine=engine, events=spans
    )
    first, second = build_rollout_spans(spans.spans(), 2)
    assert [(s.kind, s.turn, s.failed) for s in first.spans] == [
        ("reset", None, False),
        ("generate", 0, False),
        ("step", 0, False),
        ("generate", 1, False),
        ("step", 1, False),
        ("close", 1, False),
    ]
    assert [(s.kind, s.turn, s.failed) for s in second.spans][-2:] == [("step", 1, True), ("close", 1, False)]
    for rollout in (first, second):
        assert all(0 <= s.start_s <= s.end_s for s in rollout.spans)
        starts = [s.start_s for s in rollout.spans]
        assert starts == sorted(starts)
