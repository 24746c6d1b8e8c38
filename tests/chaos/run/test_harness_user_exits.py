"""A ``SystemExit`` or ``asyncio.CancelledError`` that a scenario's own env or pipeline raises at run time is
that scenario's error: it is reported (status ``error``, reports written), the next scenarios still run,
and the exit code says something went wrong; a real cancellation of the harness still ends the run.

The runs are on a ``ScriptedEngine`` instead of vLLM (``Bench.local`` is replaced), so they take
milliseconds: what is tested is the harness around the batch, not generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import secrets
import textwrap
from pathlib import Path

import pytest

import gym_resilience.models
from gym_resilience.engines.scripted import ScriptedEngine
from harness.cli import main
from harness.judge.verdict import run_scenario
from harness.run.bench import Bench
from harness.scenario.loader import load_scenario

ENVS = """
import asyncio
import sys

import gymnasium


class Env(gymnasium.Env):
    def __init__(self, task):
        self.task = task

    def reset(self, *, seed=None, options=None):
        return list(self.task.prompt), {}

    def step(self, action):
        if self.task.env_kwargs.get("exit"):
            sys.exit(3)
        return [{"role": "user", "content": "no"}], 0.0, True, False, {}


def make_env(task):
    return Env(task)


def load_tasks():
    from gym_resilience import Task

    return [
        Task([{"role": "user", "content": f"task {i}"}], instance_id=f"t{i}", env_kwargs={"exit": i == 1})
        for i in range(3)
    ]


BUILT: dict[str, int] = {}


def make_env_exiting_later(task):
    BUILT[task.instance_id] = BUILT.get(task.instance_id, 0) + 1
    if BUILT[task.instance_id] > 1:
        task = type(task)(prompt=task.prompt, instance_id=task.instance_id, env_kwargs={"exit": True})
    return Env(task)


def load_calm_tasks():
    return [task for task in load_tasks() if not task.env_kwargs["exit"]]


async def exits(tasks, env_factory, engine):
    sys.exit(0)


async def cancelled(tasks, env_factory, engine):
    raise asyncio.CancelledError()


async def exits_in_a_task(tasks, env_factory, engine):
    async def rollout(task):
        env = env_factory(task)
        try:
            env.reset(options={"task": task})
            return await asyncio.to_thread(env.step, "guess")
        finally:
            env.close()

    # The pipeline swallows its tasks' errors: the SystemExit of one must still be the run's error.
    await asyncio.gather(*(rollout(task) for task in tasks), return_exceptions=True)
    return []


async def waits(tasks, env_factory, engine):
    await asyncio.sleep(3600)
"""


@pytest.fixture
def scripted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scenarios run on a ScriptedEngine, and the tiny model is never built."""
    engine = ScriptedEngine()

    async def local(self: Bench, model_dir: Path, max_model_len: int) -> ScriptedEngine:
        return engine

    model = tmp_path / "no-model"
    model.mkdir()
    monkeypatch.setattr(Bench, "local", local)
    monkeypatch.setattr(gym_resilience.models, "build_tiny_model", lambda *args, **kwargs: model)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")


def user_scenarios(folder: Path, scenarios: dict[str, str]) -> str:
    """Writes a uniquely named user module and the scenario files (``{module}`` in their text names it)."""
    folder.mkdir(parents=True, exist_ok=True)
    module = f"exits_{secrets.token_hex(4)}"  # modules stay imported for the session: never reuse a name
    (folder / f"{module}.py").write_text(ENVS)
    for name, text in scenarios.items():
        (folder / name).write_text(textwrap.dedent(text).replace("{module}", module))
    return module


def run(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["chaos", "run", "-v", *argv])
    return code, err.getvalue()


HELD = """
title: the bundled env, untouched
batch: {env: word_game, tasks: 2}
probes:
  - {probe: batch_size, eq: 2}
"""


@pytest.mark.parametrize(
    ("scenario", "raised"),
    [
        ("batch: {env: '{module}:make_env', tasks: '{module}:load_tasks'}", "SystemExit: 3"),
        (
            "batch: {env: '{module}:make_env', tasks: '{module}:load_tasks'}\n"
            "runner: {skip_failed_rollouts: true}",
            "SystemExit: 3",
        ),
        (
            "batch: {env: '{module}:make_env', tasks: '{module}:load_tasks'}\npipeline: '{module}:exits'",
            "SystemExit: 0",
        ),
        (
            "batch: {env: '{module}:make_env', tasks: '{module}:load_tasks'}\npipeline: '{module}:cancelled'",
            "CancelledError",
        ),
        (
            "batch: {env: '{module}:make_env', tasks: '{module}:load_tasks'}\n"
            "pipeline: '{module}:exits_in_a_task'",
            "SystemExit: 3",
        ),
    ],
    ids=["env", "env-skipping-failures", "pipeline", "pipeline-cancelled", "pipeline-task"],
)
def test_a_user_exit_at_run_time_is_the_scenarios_error_and_the_next_scenarios_run(
    tmp_path: Path, scripted: None, scenario: str, raised: str
) -> None:
    folder = tmp_path / "scenarios"
    user_scenarios(folder, {"1_exits.yaml": f"title: user code exits\n{scenario}\n", "2_held.yaml": HELD})
    journal = tmp_path / "journal.json"
    code, err = run(str(folder), "--out", str(tmp_path / "runs"), "--journal", str(journal))
    assert code == 1, err
    assert "Traceback" not in err
    results = json.loads(journal.read_text())["scenarios"]
    assert [(Path(r["file"]).name, r["status"]) for r in results] == [
        ("1_exits.yaml", "error"),
        ("2_held.yaml", "held"),
    ]
    message = results[0]["message"]
    assert message.startswith(f"the fault-free baseline raised {raised} in the scenario's env or pipeline")
    assert "raise an Exception instead" in message


def test_a_user_exit_in_the_faulted_run_only_is_its_error(tmp_path: Path, scripted: None) -> None:
    folder = tmp_path / "scenarios"
    user_scenarios(
        folder,
        {
            "later.yaml": """
                title: the env exits the second time it is built, in the faulted run
                batch: {env: '{module}:make_env_exiting_later', tasks: '{module}:load_calm_tasks'}
                runner: {skip_failed_rollouts: true}
                faults:
                  - {target: env, kind: delay, delay_s: 0.01}
            """
        },
    )
    journal = tmp_path / "journal.json"
    code, err = run(str(folder / "later.yaml"), "--out", str(tmp_path / "runs"), "--journal", str(journal))
    assert code == 1, err
    result = json.loads(journal.read_text())["scenarios"][0]
    assert result["status"] == "error"
    assert result["message"].startswith("the faulted run raised SystemExit: 3 in the scenario's env")
    assert result["probes"][0]["observed"] == "raises SystemExit"


async def test_a_real_cancellation_of_the_harness_still_ends_the_run(tmp_path: Path, scripted: None) -> None:
    folder = tmp_path / "scenarios"
    user_scenarios(
        folder,
        {
            "waits.yaml": """
                title: the pipeline waits
                batch: {env: '{module}:make_env', tasks: '{module}:load_tasks'}
                pipeline: '{module}:waits'
            """
        },
    )
    bench = Bench()
    task = asyncio.create_task(run_scenario(load_scenario(folder / "waits.yaml"), bench))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await bench.aclose()
