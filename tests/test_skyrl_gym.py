"""skyrl-gym envs under BatchRunner through ``gym_resilience.adapters.skyrl_gym``.

Real skyrl-gym envs (gsm8k, gsm8k_multi_turn, text2sql on a SQLite database built here, and the
gsm8k_multi_turn of skyrl_envs.py that fails where a test's faults say); the batch tests run real vLLM
generation on the bundled tiny model, whose text is nonsense, so they check structure, not scores.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import logging
import pickle
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import skyrl_envs
from doubles import Fault
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from skyrl_envs import FLAKY_ID, TUPLE_STEP_ID, faults
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.envs.registration import EnvSpec as SkyRLEnvSpec

from gym_resilience import (
    BatchRunner,
    DependencyNotInstalledError,
    EnvStepError,
    ResilientEnv,
    RunnerConfig,
    Task,
    Trajectory,
    UnsupportedConfigError,
    validate_batch_output,
)
from gym_resilience.adapters.skyrl_gym import SkyRLGymEnv, skyrl_gym_factory
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.errors import root_cause
from gym_resilience.trajectories import GENERATOR_OUTPUT_KEYS

GOLD_SQL = "SELECT name FROM singer ORDER BY age DESC LIMIT 1"
DOCS = Path(__file__).resolve().parent.parent / "docs"
TEARDOWN_FAILS = faults(Fault(phase="close", error=OSError, message="sandbox teardown failed"))


def connection_drops(turn: int) -> dict[str, Any]:
    """The extras of a flaky env whose sandbox connection drops in its step of ``turn``."""
    return faults(Fault(turn=turn, error=ConnectionError, message="sandbox connection dropped"))


def task(index: int, question: str = "What is 6 x 7?", **extras: Any) -> Task:
    """A gsm8k-style task whose answer is 42; ``extras`` go into the env's extras beside the reward spec."""
    return Task(
        prompt=[{"role": "user", "content": f"{question} (question {index})"}],
        instance_id=f"q{index}",
        env_kwargs={"reward_spec": {"ground_truth": "42"}, **extras},
    )


@pytest.fixture
def sql_root(tmp_path: Path) -> Path:
    """A spider-layout folder with one SQLite database, ``concerts``, as skyrl-gym's text2sql reads it."""
    folder = tmp_path / "spider" / "database" / "concerts"
    folder.mkdir(parents=True)
    with sqlite3.connect(folder / "concerts.sqlite") as db:
        db.execute("CREATE TABLE singer (name TEXT, age INTEGER)")
        db.executemany("INSERT INTO singer VALUES (?, ?)", [("Ada", 36), ("Bo", 52)])
    return tmp_path


def sql_task(index: int, max_turns: int = 2) -> Task:
    return Task(
        prompt=[{"role": "user", "content": f"Who is the oldest singer? (question {index})"}],
        instance_id=f"sql{index}",
        env_kwargs={
            "db_id": "concerts",
            "data": "spider",
            "reward_spec": {"ground_truth": GOLD_SQL},
            "max_turns": max_turns,
        },
    )


# The adapter, driven by hand.


def test_reset_hands_the_prompt_to_init_and_step_maps_the_dict_to_gymnasiums_five_tuple() -> None:
    env = skyrl_gym_factory("gsm8k")(task(0))
    assert isinstance(env, SkyRLGymEnv)
    observation, info = env.reset(seed=3)
    assert observation == [{"role": "user", "content": "What is 6 x 7? (question 0)"}] and info == {}
    assert env.step("six times seven is #### 42") == ([], 1.0, True, False, {})
    env.close()


def test_the_tasks_env_kwargs_are_the_envs_extras_and_get_metrics_lands_in_info() -> None:
    env = skyrl_gym_factory("gsm8k_multi_turn")(task(0, max_turns=2))
    env.reset()
    observation, reward, terminated, truncated, info = env.step("no idea")
    assert (reward, terminated, truncated, info) == (0, False, False, {"steps": 1})
    assert observation[0]["role"] == "user" and "#### ANSWER" in observation[0]["content"]
    # max_turns=2 came from env_kwargs: the second step ends the episode.
    assert env.step("still no idea")[2:] == (True, False, {"steps": 2})


@pytest.mark.parametrize("env_id", ["acme/gsm8k", "gsm8k multi", "gsm8k@v2"])
def test_an_env_id_skyrl_gym_takes_but_gymnasium_would_not_parse_still_builds_and_runs(env_id: str) -> None:
    from skyrl_gym.envs import registration

    registration.register(id=env_id, entry_point="skyrl_gym.envs.gsm8k.env:GSM8kEnv")
    try:
        env = skyrl_gym_factory(env_id)(task(0))
        assert env.spec is not None and env.spec.id.startswith("skyrl_gym/")
        env.reset()
        assert env.step("six times seven is #### 42")[1:3] == (1.0, True)
        env.close()
    finally:
        registration.registry.pop(env_id)


def test_a_second_reset_starts_a_fresh_episode_from_a_new_env() -> None:
    env = skyrl_gym_factory("gsm8k_multi_turn")(task(0, max_turns=3))
    env.reset()
    first = env.env
    env.step("a")
    env.step("b")
    env.reset()
    assert env.env is not first
    assert env.step("c")[4] == {"steps": 1}


# Every skyrl-gym env the adapter builds is closed exactly once, whatever fails.


class InjectedError(RuntimeError):
    """What a counting env raises where its ledger says; the message names the fault."""


@dataclasses.dataclass
class Ledger:
    """The envs a counting env's adapter built and closed (by serial number), and the faults to inject."""

    built: list[int] = dataclasses.field(default_factory=list)
    closes: list[int] = dataclasses.field(default_factory=list)
    fault: str | None = None  # "build", "init", "step" or "close": that call of any env raises

    def fire(self, where: str) -> None:
        if self.fault == where:
            raise InjectedError(where)


class CountingTextEnv(BaseTextEnv):
    """A skyrl-gym env that records its build and each close in ``ledger``, and fails where it says."""

    def __init__(self, ledger: Ledger, env_config: Any = None, extras: Any = None) -> None:
        ledger.fire("build")
        super().__init__()
        self.ledger = ledger
        self.serial = len(ledger.built)
        ledger.built.append(self.serial)

    def init(self, prompt: Any) -> Any:
        self.ledger.fire("init")
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.ledger.fire("step")
        self.turns += 1
        return BaseTextEnvStepOutput(observations=[], reward=0.0, done=False, metadata={})

    def close(self) -> None:
        self.ledger.closes.append(self.serial)  # counted first: a close that raises still ran
        self.ledger.fire("close")


def counting_env(ledger: Ledger) -> SkyRLGymEnv:
    spec = SkyRLEnvSpec(id="counting", entry_point=functools.partial(CountingTextEnv, ledger))
    return SkyRLGymEnv(spec, prompt=task(0).prompt, extras={})


def outcome(call: Any, ledger: Ledger, fault: str | None) -> str | None:
    """``call()`` with ``fault`` injected: None, or its failure's root cause as ``"Type: message"``."""
    ledger.fault = fault
    try:
        call()
    except Exception as error:
        cause = root_cause(error)
        return f"{type(cause).__name__}: {cause}"
    finally:
        ledger.fault = None
    return None


CLOSED = "EnvClosedError: cannot reset: the env is closed [skyrl_gym/counting]"
ORDERINGS: dict[str, list[tuple[str, str | None, str | None]]] = {
    # (operation, the fault injected, the root cause of its failure)
    "reset, reset failing at its rebuild, close": [
        ("reset", None, None),
        ("reset", "build", "InjectedError: build"),
        ("close", None, None),
    ],
    "reset, reset failing in init, close": [
        ("reset", None, None),
        ("reset", "init", "InjectedError: init"),
        ("close", None, None),
    ],
    "reset, reset failing to close the old env, close": [
        ("reset", None, None),
        ("reset", "close", "InjectedError: close"),
        ("close", None, None),
    ],
    "reset, close, close": [("reset", None, None), ("close", None, None), ("close", None, None)],
    "reset, close failing, close": [
        ("reset", None, None),
        ("close", "close", "InjectedError: close"),
        ("close", None, None),
    ],
    "reset, close, reset": [("reset", None, None), ("close", None, None), ("reset", None, CLOSED)],
}


@pytest.mark.parametrize("wrapped", [False, True], ids=["adapter", "resilient-env"])
@pytest.mark.parametrize("ordering", ORDERINGS)
def test_every_skyrl_env_the_adapter_builds_is_closed_exactly_once_whatever_fails(
    ordering: str, wrapped: bool
) -> None:
    ledger = Ledger()
    adapter = counting_env(ledger)
    env: Any = ResilientEnv(adapter) if wrapped else adapter
    calls = {"reset": env.reset, "close": env.close}
    seen = [
        (operation, fault, outcome(calls[operation], ledger, fault))
        for operation, fault, _ in ORDERINGS[ordering]
    ]
    assert seen == ORDERINGS[ordering]
    assert sorted(ledger.closes) == ledger.built


def test_a_step_after_a_reset_that_failed_to_rebuild_raises_and_closes_nothing_twice() -> None:
    ledger = Ledger()
    env = counting_env(ledger)
    env.reset()
    assert outcome(env.reset, ledger, "build") == "InjectedError: build"
    assert outcome(lambda: env.step("a"), ledger, None) == (
        "RuntimeError: cannot step: the last reset failed before it built a skyrl-gym env"
    )
    env.close()
    assert (ledger.built, ledger.closes) == ([0], [0])


class SkyRLAdapterLifecycle(RuleBasedStateMachine):
    """Random reset/step/close with faults on the adapter: models whether it is closed, whether it was
    reset, and whether it holds an env; at most one built env is open, the one it holds, and none is
    closed twice."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger()
        self.env = counting_env(self.ledger)
        self.closed = False
        self.started = False
        self.holds_env = True

    @rule(fault=st.sampled_from([None, "build", "init", "close"]))
    def reset(self, fault: str | None) -> None:
        seen = outcome(self.env.reset, self.ledger, fault)
        expected: str | None = None
        if self.closed:
            expected = CLOSED
        elif self.started and self.holds_env and fault == "close":
            expected, self.holds_env = "InjectedError: close", False
        elif self.started and fault == "build":
            expected, self.holds_env = "InjectedError: build", False
        else:
            self.holds_env = True
            self.started = True
            expected = "InjectedError: init" if fault == "init" else None
        assert seen == expected

    @rule(fault=st.sampled_from([None, "step"]))
    def step(self, fault: str | None) -> None:
        seen = outcome(lambda: self.env.step("a"), self.ledger, fault)
        if self.closed:
            expected = "EnvClosedError: cannot step: the env is closed [skyrl_gym/counting]"
        elif not self.holds_env:
            expected = "RuntimeError: cannot step: the last reset failed before it built a skyrl-gym env"
        else:
            expected = "InjectedError: step" if fault else None
        assert seen == expected

    @rule(fault=st.sampled_from([None, "close"]))
    def close(self, fault: str | None) -> None:
        seen = outcome(self.env.close, self.ledger, fault)
        assert seen == ("InjectedError: close" if fault and self.holds_env and not self.closed else None)
        self.closed, self.holds_env = True, False

    @invariant()
    def only_the_env_it_holds_is_open_and_none_was_closed_twice(self) -> None:
        assert len(self.ledger.closes) == len(set(self.ledger.closes))
        still_open = set(self.ledger.built) - set(self.ledger.closes)
        assert still_open == ({self.env.env.serial} if self.holds_env else set())

    def teardown(self) -> None:
        self.env.close()
        assert sorted(self.ledger.closes) == self.ledger.built


SkyRLAdapterLifecycle.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
test_the_skyrl_adapter_closes_every_env_it_builds_exactly_once_in_any_order_of_calls_and_faults = (
    SkyRLAdapterLifecycle.TestCase
)


def test_text2sql_runs_its_sql_tool_against_the_database_and_scores_the_solution(sql_root: Path) -> None:
    env = skyrl_gym_factory("text2sql", {"db_path": str(sql_root)})(sql_task(0, max_turns=3))
    env.reset()
    observation, reward, terminated, _, info = env.step(
        "<think>look</think><sql>SELECT name, age FROM singer</sql>"
    )
    assert (reward, terminated, info["tool_name"]) == (0, False, "sql")
    assert "<observation>" in observation[0]["content"]
    assert "Ada" in observation[0]["content"] and "Bo" in observation[0]["content"]
    solved = env.step("<think>Bo is 52</think><solution>SELECT name FROM singer WHERE age = 52</solution>")
    assert solved[1:3] == (1.0, True)
    env.close()


def test_without_skyrl_gym_the_factory_raises_dependency_not_installed_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "skyrl_gym", None)  # what import finds when the package is absent
    with pytest.raises(DependencyNotInstalledError) as info:
        skyrl_gym_factory("gsm8k")
    # The message ends with the root cause, as every gym_resilience error's does.
    assert str(info.value).startswith(
        "skyrl-gym is not installed; install it with: pip install 'gym-resilience[skyrl]': "
        "ModuleNotFoundError"
    )
    assert (info.value.package, info.value.extra) == ("skyrl-gym", "'gym-resilience[skyrl]'")
    assert isinstance(info.value, ImportError)


def test_an_unknown_env_id_is_rejected_naming_the_registered_ones() -> None:
    with pytest.raises(UnsupportedConfigError) as info:
        skyrl_gym_factory("gsm9k")
    assert info.value.option == "env_id"
    assert str(info.value).startswith("env_id: no skyrl-gym env is registered as 'gsm9k'; registered: ")
    assert "gsm8k, gsm8k_multi_turn" in str(info.value)


def test_a_step_that_returns_gymnasiums_tuple_fails_as_env_step_error_naming_the_protocol() -> None:
    env = ResilientEnv(skyrl_gym_factory(TUPLE_STEP_ID)(task(0, max_turns=2)))
    env.reset()
    with pytest.raises(EnvStepError) as info:
        env.step("a")
    assert isinstance(info.value.__cause__, TypeError)
    assert str(info.value) == (
        "env step failed at turn 0 (action='a') [skyrl_gym/tuple_step_gsm8k]: TypeError: a skyrl-gym env's "
        "step must return a dict with observations, reward and done, got tuple: ([], 0.0, True, False, {})"
    )
    assert env.closed


def test_a_failing_step_is_a_typed_error_with_the_envs_exception_as_cause_and_the_env_closes_once() -> None:
    skyrl_envs.CLOSED.clear()
    env = ResilientEnv(skyrl_gym_factory(FLAKY_ID)(task(0, max_turns=3, tag="e0", **connection_drops(1))))
    env.reset()
    env.step("a")
    with pytest.raises(EnvStepError) as info:
        env.step("b")
    assert isinstance(info.value.__cause__, ConnectionError)
    assert str(info.value) == (
        "env step failed at turn 1 (action='b') [skyrl_gym/flaky_gsm8k_multi_turn]: "
        "ConnectionError: sandbox connection dropped"
    )
    env.close()
    env.close()
    assert skyrl_envs.CLOSED == ["e0"]


def test_the_factory_pickles_and_its_env_runs_isolated_in_a_worker_with_the_same_typed_errors() -> None:
    factory = skyrl_gym_factory(FLAKY_ID)
    assert pickle.loads(pickle.dumps(factory)) == factory
    env = ResilientEnv.isolated(functools.partial(factory, task(0, max_turns=3, **connection_drops(1))))
    try:
        assert env.reset()[0] == task(0).prompt
        assert env.step("a")[1:] == (0, False, False, {"steps": 1})
        with pytest.raises(EnvStepError) as info:
            env.step("b")
        assert isinstance(info.value.__cause__, ConnectionError)
        assert env.closed
    finally:
        env.close()


async def test_an_isolated_env_whose_close_fails_after_a_complete_episode_keeps_its_trajectory(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = RunnerConfig(skip_failed_rollouts=False, max_turns=2, max_tokens=8, isolate_envs=True)
    tasks = [task(i, max_turns=2, **(TEARDOWN_FAILS if i == 1 else {})) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="gym_resilience"):
        result = await BatchRunner(ScriptedEngine(), skyrl_gym_factory(FLAKY_ID), config).generate(tasks)
    assert [t.close_error for t in result.trajectories] == [None, "OSError: sandbox teardown failed", None]
    assert result.metrics["env_close_errors"] == 1.0
    assert any("rollout 1 (q1_0): closing its env failed" in record.getMessage() for record in caplog.records)


# Batches on real vLLM.


def runner(engine: Any, factory: Any, **options: Any) -> BatchRunner:
    config = RunnerConfig(max_tokens=16, **{"skip_failed_rollouts": True, **options})
    return BatchRunner(engine, factory, config)


@pytest.mark.slow
async def test_a_gsm8k_batch_on_vllm_is_one_scored_turn_per_rollout_and_exports_valid(
    vllm_engine: Any,
) -> None:
    result = await runner(
        vllm_engine, skyrl_gym_factory("gsm8k"), max_turns=1, n_samples_per_prompt=2
    ).generate([task(i) for i in range(3)])
    ids = [str(t.trajectory_id) for t in result.trajectories]
    assert ids == [f"q{i}_{repetition}" for i in range(3) for repetition in range(2)]
    for trajectory in result.trajectories:
        assert isinstance(trajectory, Trajectory) and not trajectory.is_placeholder
        assert trajectory.reward in (0.0, 1.0)  # gsm8k scores a reply 1.0 or 0
        assert set(trajectory.loss_mask) == {1}  # one turn: every token is generated
    validate_batch_output(result.output.to_dict(), num_prompts=6)
    assert result.metrics["rollout_errors"] == 0.0


@pytest.mark.slow
async def test_gsm8k_multi_turn_with_failing_steps_keeps_the_batch_with_placeholders(
    vllm_engine: Any,
) -> None:
    tasks = [task(i, max_turns=3, **(connection_drops(1) if i in (1, 3) else {})) for i in range(5)]
    result = await runner(vllm_engine, skyrl_gym_factory(FLAKY_ID), max_turns=3).generate(tasks)
    assert [t.is_placeholder for t in result.trajectories] == [False, True, False, True, False]
    for index in (1, 3):
        failure = result.failures[[f.rollout_index for f in result.failures].index(index)]
        assert isinstance(failure.exception, EnvStepError)
        assert isinstance(failure.exception.__cause__, ConnectionError)
        assert (failure.phase, failure.turn) == ("step", 1)
    for index in (0, 2, 4):
        trajectory = result.trajectories[index]
        assert isinstance(trajectory, Trajectory)
        turns = trajectory.env_metrics["steps"]  # get_metrics() of the last step
        assert 1 <= turns <= 3
        generated_runs = "".join(map(str, trajectory.loss_mask)).split("0")
        assert len([run for run in generated_runs if run]) == turns  # one generated run per turn
    assert result.metrics["rollout_errors/cause/ConnectionError"] == 2.0
    exported = result.output.to_dict()
    validate_batch_output(exported, num_prompts=5)
    placeholders = [reason == "rollout_error" for reason in exported["stop_reasons"]]
    assert placeholders == [False, True, False, True, False]
    assert exported["env_metrics"][1] == {}


@pytest.mark.slow
async def test_a_text2sql_batch_on_vllm_runs_the_sql_tool_each_turn_and_scores_at_the_end(
    vllm_engine: Any, sql_root: Path
) -> None:
    factory = skyrl_gym_factory("text2sql", {"db_path": str(sql_root)})
    result = await runner(vllm_engine, factory, max_turns=2).generate([sql_task(i) for i in range(3)])
    tokenizer = vllm_engine.tokenizer
    for trajectory in result.trajectories:
        assert isinstance(trajectory, Trajectory) and not trajectory.is_placeholder
        # Nonsense never closes a <solution>, so turn 1 runs the tool and turn 2 (max_turns) ends the
        # episode, which text2sql scores -1.0 for a reply without its format.
        assert trajectory.reward == -1.0
        env_text = tokenizer.decode(
            [t for t, m in zip(trajectory.response_ids, trajectory.loss_mask, strict=True) if m == 0]
        )
        assert "<observation>" in env_text and "turns left" in env_text
    validate_batch_output(result.output.to_dict(), num_prompts=3)


@pytest.mark.slow
async def test_isolated_skyrl_envs_with_failing_steps_are_contained_as_placeholders(vllm_engine: Any) -> None:
    tasks = [task(i, max_turns=2, **(connection_drops(0) if i == 2 else {})) for i in range(4)]
    result = await runner(vllm_engine, skyrl_gym_factory(FLAKY_ID), max_turns=2, isolate_envs=True).generate(
        tasks
    )
    assert [t.is_placeholder for t in result.trajectories] == [False, False, True, False]
    [failure] = result.failures
    assert isinstance(failure.exception, EnvStepError)
    assert isinstance(failure.exception.__cause__, ConnectionError)
    validate_batch_output(result.output.to_dict(), num_prompts=4)


@pytest.mark.slow
async def test_without_the_flag_a_failing_skyrl_env_aborts_the_batch_and_every_env_is_closed(
    vllm_engine: Any,
) -> None:
    skyrl_envs.CLOSED.clear()
    tasks = [task(i, max_turns=2, tag=f"e{i}", **(connection_drops(0) if i == 1 else {})) for i in range(4)]
    with pytest.raises(EnvStepError) as info:
        await runner(
            vllm_engine, skyrl_gym_factory(FLAKY_ID), max_turns=2, skip_failed_rollouts=False
        ).generate(tasks)
    assert isinstance(info.value.__cause__, ConnectionError)
    assert sorted(skyrl_envs.CLOSED) == ["e0", "e1", "e2", "e3"]


@pytest.mark.slow
def test_the_example_of_coming_from_skyrl_runs_as_a_script(tmp_path: Path) -> None:
    page = DOCS.joinpath("coming-from-skyrl.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```$", page, re.MULTILINE | re.DOTALL)
    # The page's script of our own runner; its SkyRL trainer override runs in tests/skyrl, beside SkyRL.
    [block] = [b for b in blocks if "BatchRunner(" in b]
    script = tmp_path / "coming_from_skyrl.py"
    script.write_text(block, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    keys, _, avg_num_tokens = done.stdout.strip().splitlines()[-1].rpartition(" ")
    assert ast.literal_eval(keys) == sorted(GENERATOR_OUTPUT_KEYS)
    assert float(avg_num_tokens) >= 1.0
