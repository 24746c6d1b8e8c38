"""Chaos scenarios on the user's own parts: their env, task loader, model and pipeline, named from scenario
files that live outside the project, faulted like the bundled ones, and reported truthfully.

The user's package is ``tests/user_pkg``, copied next to the scenario files under another name (so it is
imported from there, as a user's would be), with a model folder the user built (``build_tiny_model``).
"""

from __future__ import annotations

import importlib
import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import yaml

from gym_resilience import BatchOutput, Trajectory, TrajectoryId, build_batch_output
from gym_resilience.models import build_tiny_model
from harness.cli import main
from harness.judge.probes import RunOutcome
from harness.judge.results import FaultFiring, RunJournal
from harness.judge.verdict import judge
from harness.reports import junit_tree
from harness.run.outcome import RolloutEnds
from harness.run.recorder import Recording
from harness.scenario.compile import CompiledScenario
from harness.scenario.loader import load_scenario

USER_PACKAGE = Path(__file__).resolve().parents[2] / "user_pkg"


def user_project(root: Path, package: str, model: Path | None = None) -> Path:
    """A folder of scenario files with the user's package (as ``package``) beside them; the model folder
    is ``model``, or a stand-in holding only a ``config.json`` (enough to load, not to run)."""
    folder = root / "scenarios"
    folder.mkdir(parents=True)
    shutil.copytree(USER_PACKAGE, folder / package)
    if model is None:
        (folder / "model").mkdir()
        (folder / "model" / "config.json").write_text("{}")
    else:
        shutil.copytree(model, folder / "model")
    for name, text in scenario_files(package).items():
        (folder / name).write_text(text)
    return folder


def scenario_files(package: str) -> dict[str, str]:
    batch = f"batch: {{env: '{package}.envs:make_env', tasks: '{package}.data:load_tasks'}}"
    return {
        "1_user_pipeline.yaml": f"""
title: The user's pipeline builds its envs with the faulted factory it is handed
tags: [user, pipeline]
seed: 1
model: ./model
{batch}
pipeline: '{package}.pipeline:run'
faults:
  - {{target: env, kind: raise, method: step, exception: ConnectionResetError, message: sandbox dropped,
      when: {{rollouts: [2], turns: [0]}}}}
  - {{target: engine, kind: delay, delay_s: 0.05, when: {{nth_call: [0]}}}}
probes:
  - {{probe: batch_size, eq: 6}}
  - {{probe: placeholders, eq: 1}}
  - {{probe: faults_fired, eq: 2}}
  - {{probe: envs_unclosed, eq: 0}}
  - {{probe: identical_to_baseline, is: true}}
""",
        "2_user_env.yaml": f"""
title: The user's env and tasks on the user's model lose two rollouts to flaky steps
tags: [user, env]
seed: 2
model: ./model
{batch}
runner: {{skip_failed_rollouts: true, max_turns: 2, max_tokens: 8}}
faults:
  - {{target: env, kind: raise, method: step, exception: ConnectionResetError, message: sandbox dropped,
      when: {{rollouts: [1, 4], turns: [0]}}}}
probes:
  - {{probe: batch_size, eq: 6}}
  - {{probe: placeholders, eq: 2}}
  - {{probe: faults_fired, eq: 2}}
  - {{probe: envs_unclosed, eq: 0}}
  - {{probe: identical_to_baseline, is: true}}
""",
        "3_impossible.yaml": """
title: A probe that cannot hold
tags: [bundled]
seed: 1
model: ./model
batch: {env: word_game, tasks: 4}
runner: {skip_failed_rollouts: true, max_turns: 2, max_tokens: 8}
faults:
  - {target: env, kind: raise, method: step, exception: ConnectionError, when: {rollouts: [1], turns: [0]}}
probes:
  - {probe: placeholders, eq: 3}
  - {probe: envs_unclosed, eq: 0}
""",
        "4_after_the_failure.yaml": """
title: Never run, because the one before it deviated
tags: [bundled]
model: ./model
batch: {env: word_game, tasks: 2}
runner: {max_tokens: 4}
""",
    }


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- without vLLM -----------------------------------------------------------------------------------------


def test_a_scenario_outside_the_project_compiles_the_users_env_tasks_pipeline_and_model(
    tmp_path: Path,
) -> None:
    folder = user_project(tmp_path, "acme_compiled")
    compiled = load_scenario(folder / "1_user_pipeline.yaml")
    # Importable now that the scenario put its folder on sys.path.
    envs, data, pipeline = (
        importlib.import_module(f"acme_compiled.{name}") for name in ("envs", "data", "pipeline")
    )
    assert Path(envs.__file__ or "").is_relative_to(folder)
    assert compiled.env_factory is envs.make_env
    assert compiled.pipeline is pipeline.run
    assert list(compiled.tasks) == data.load_tasks()
    assert compiled.model_dir == folder / "model"
    assert compiled.exceptions == {0: ConnectionResetError}


def test_dry_run_prints_what_k_and_tags_select_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = user_project(tmp_path, "acme_dry")
    code, out, err = cli(capsys, "chaos", "run", str(folder), "--dry-run", "-k", "user and not pipeline")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"{folder / '2_user_env.yaml'}: The user's env and tasks on the user's model lose two rollouts to "
        "flaky steps",
        f"    in-process vLLM serving {folder / 'model'}; env acme_dry.envs:make_env, 6 tasks; BatchRunner; "
        "1 fault, 5 probes",
        "1 scenario would run on cpu; dry run: nothing was started",
    ]
    code, out, _ = cli(capsys, "chaos", "run", str(folder), "--dry-run", "--tags", "pipeline,bundled")
    assert code == 0
    assert [line for line in out.splitlines() if not line.startswith(" ")][:-1] == [
        f"{folder / '1_user_pipeline.yaml'}: The user's pipeline builds its envs with the faulted factory "
        "it is handed",
        f"{folder / '3_impossible.yaml'}: A probe that cannot hold",
        f"{folder / '4_after_the_failure.yaml'}: Never run, because the one before it deviated",
    ]
    assert "pipeline acme_dry.pipeline:run; 2 faults, 5 probes" in out
    assert not (tmp_path / "chaos-runs").exists()


@pytest.mark.parametrize(
    ("expression", "titles"),
    [
        ("(env or pipeline) and not 2_", ["1_user_pipeline.yaml"]),
        ("IMPOSSIBLE or never", ["3_impossible.yaml", "4_after_the_failure.yaml"]),
        ("not user", ["3_impossible.yaml", "4_after_the_failure.yaml"]),
    ],
)
def test_k_matches_words_in_file_names_and_titles_with_and_or_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], expression: str, titles: list[str]
) -> None:
    folder = user_project(tmp_path, f"acme_k{len(titles)}{len(expression)}")
    code, out, _ = cli(capsys, "chaos", "run", str(folder), "--dry-run", "-k", expression)
    assert code == 0
    assert [
        Path(line.split(":")[0]).name for line in out.splitlines() if line.startswith(str(folder))
    ] == titles


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["-k", "user and"], "gym-resilience: -k 'user and': it ends where a word is expected"),
        (["-k", "(user"], "gym-resilience: -k '(user': a '(' is never closed"),
        (["-k", "or user"], "gym-resilience: -k 'or user': expected a word, got 'or'"),
        (
            ["-k", "nothing_has_this", "--tags", "user"],
            "gym-resilience: no scenario matches -k 'nothing_has_this' --tags 'user'; 4 valid scenario files "
            "were given",
        ),
    ],
)
def test_a_selection_that_is_malformed_or_selects_nothing_exits_2_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    folder = user_project(tmp_path, f"acme_bad{len(options)}{len(message)}")
    code, out, err = cli(capsys, "chaos", "run", str(folder), "--out", str(tmp_path / "runs"), *options)
    assert (code, out, err) == (2, "", message + "\n")
    assert not (tmp_path / "runs").exists()


def test_keep_going_with_dry_run_reports_the_invalid_files_lists_the_valid_ones_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = user_project(tmp_path, "acme_keep")
    broken = "title: broken\nbatch: {env: 'acme_keep.envs:make_evn', tasks: 'acme_keep.data:load_tasks'}\n"
    (folder / "0_broken.yaml").write_text(broken)
    code, out, err = cli(capsys, "chaos", "run", str(folder), "--dry-run")
    assert (code, out) == (2, "")
    assert err == (
        f"invalid scenario: {folder / '0_broken.yaml'}:2 at batch.env: module 'acme_keep.envs' has no "
        "attribute 'make_evn'; did you mean 'make_env'?\n"
    )
    code, out, err = cli(capsys, "chaos", "run", str(folder), "--dry-run", "--keep-going")
    assert code == 2
    assert err.startswith(f"invalid scenario: {folder / '0_broken.yaml'}:2 at batch.env")
    assert out.splitlines()[-1] == "4 scenarios would run on cpu; dry run: nothing was started"


def pipeline_output(placeholders: set[int]) -> BatchOutput:
    """What a user pipeline returns: a ``BatchOutput`` whose only record of failures is ``is_placeholder``."""
    return build_batch_output(
        [
            Trajectory([1], [2, 3], 0.0, [1, 1], "stop", trajectory_id=TrajectoryId(f"guess-{index}"))
            if index not in placeholders
            else Trajectory(
                [0], [0], 0.0, [0], "error", trajectory_id=TrajectoryId(f"guess-{index}"), is_placeholder=True
            )
            for index in range(6)
        ]
    )


def run_outcome(output: BatchOutput, *, envs_created: int, firings: list[FaultFiring]) -> RunOutcome:
    """A pipeline's run as ``run_batch`` records it: its rollouts' ends read from the output's columns."""
    return RunOutcome(
        trajectories=None,
        output=output,
        metrics={},
        error=None,
        wall_s=1.0,
        recording=Recording(firings=firings, envs_created=envs_created),
        ends=RolloutEnds.of_pipeline([], output, {}, samples=1),  # ids no task has: rows by position
    )


def pipeline_scenario(tmp_path: Path, package: str) -> CompiledScenario:
    return load_scenario(user_project(tmp_path, package) / "1_user_pipeline.yaml")


def test_a_pipelines_is_placeholder_column_is_what_the_journal_and_junit_report(tmp_path: Path) -> None:
    scenario = pipeline_scenario(tmp_path, "acme_truth")
    step_fault = FaultFiring(
        0, "raise", "env", 2, 0, 0, "step raised ConnectionResetError: sandbox dropped", 0.4
    )
    delay = FaultFiring(1, "delay", "engine", None, None, None, "generate delayed 0.05 s", 0.1)
    baseline = run_outcome(pipeline_output(set()), envs_created=6, firings=[])
    faulted = run_outcome(pipeline_output({2}), envs_created=6, firings=[delay, step_fault])
    result = judge(scenario, scenario.config, baseline, faulted)
    assert result.status == "held", result.probes
    assert [(r.index, r.placeholder, r.error) for r in result.rollouts if r.placeholder or r.error] == [
        (2, True, "step raised ConnectionResetError: sandbox dropped (fault 0)")
    ]
    assert next(p.observed for p in result.probes if p.probe == "placeholders") == 1
    system_out = junit_tree(RunJournal(device="cpu", scenarios=[result])).findtext(
        "testsuite/testcase/system-out"
    )
    assert "placeholder rollouts: 2\nrollout errors (1):\n  rollout 2: step raised ConnectionResetError" in (
        system_out or ""
    )


def test_a_pipeline_that_builds_its_own_envs_is_an_error_saying_the_env_faults_could_not_reach_them(
    tmp_path: Path,
) -> None:
    scenario = pipeline_scenario(tmp_path, "acme_own_envs")
    delay = FaultFiring(1, "delay", "engine", None, None, None, "generate delayed 0.05 s", 0.1)
    baseline = run_outcome(pipeline_output(set()), envs_created=0, firings=[])
    faulted = run_outcome(pipeline_output(set()), envs_created=0, firings=[delay])
    result = judge(scenario, scenario.config, baseline, faulted)
    assert (result.status, result.message) == (
        "error",
        "the env faults could not fire: the pipeline built no env with the env_factory it was given (build "
        "every env with env_factory(task), so that faults and the env ledger reach it)",
    )


# --- on real vLLM: one run of the user's scenarios --------------------------------------------------------


def by_title(journal: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {Path(result["file"]).stem: result for result in journal["scenarios"]}


def probe(result: dict[str, Any], name: str) -> Any:
    return next(p["observed"] for p in result["probes"] if p["probe"] == name)


@pytest.mark.slow
def test_the_users_env_tasks_model_and_pipeline_are_faulted_and_every_report_agrees_with_the_probes(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_session_engine: None,
) -> None:
    model = build_tiny_model(tmp_path / "built" / "my-model")
    user_project(tmp_path, "acme_run", model)
    monkeypatch.chdir(tmp_path)  # paths as a user types them: relative, printed back as given
    journal_path, junit_path = Path("out/journal.json"), Path("out/junit.xml")
    code, out, err = cli(
        capsys,
        "chaos",
        "run",
        "scenarios",
        "--fail-fast",
        "--journal",
        str(journal_path),
        "--junit",
        str(junit_path),
        "--out",
        "runs",
    )
    assert code == 1, err
    assert "building the tiny model" not in err  # every scenario names its own model
    assert "--fail-fast: stopped after the first failure; 1 of 4 scenarios not run" in err
    (folder,) = Path("runs").iterdir()
    assert out.splitlines()[-3:] == [
        f"reports: {folder}",
        f"journal: {journal_path}",
        f"JUnit XML: {junit_path}",
    ]

    journal = json.loads(journal_path.read_text())
    results = by_title(journal)
    assert [(stem, r["status"]) for stem, r in results.items()] == [
        ("1_user_pipeline", "held"),
        ("2_user_env", "held"),
        ("3_impossible", "deviated"),
    ]
    pipeline, env, impossible = results["1_user_pipeline"], results["2_user_env"], results["3_impossible"]
    assert pipeline["file"] == "scenarios/1_user_pipeline.yaml"

    # The faults fired in the user's env, at the rollouts they target, through the user's pipeline too.
    env_firings = [(f["rollout"], f["turn"], f["detail"]) for f in env["firings"]]
    assert env_firings == [
        (1, 0, "step raised ConnectionResetError: sandbox dropped"),
        (4, 0, "step raised ConnectionResetError: sandbox dropped"),
    ]
    assert [(f["rollout"], f["target"]) for f in pipeline["firings"]] == [(None, "engine"), (2, "env")]

    # Journal: each rollout's placeholder and error agree with the probes, whoever built the batch.
    def placeholders(result: dict[str, Any]) -> list[tuple[int, str | None]]:
        return [(r["index"], r["error"]) for r in result["rollouts"] if r["placeholder"]]

    assert len(placeholders(env)) == probe(env, "placeholders") == 2
    assert [index for index, _ in placeholders(env)] == [1, 4]
    assert all(
        error is not None and error.endswith("ConnectionResetError: sandbox dropped")
        for _, error in placeholders(env)
    )
    assert placeholders(pipeline) == [(2, "step raised ConnectionResetError: sandbox dropped (fault 0)")]
    assert probe(pipeline, "placeholders") == 1
    assert [r["error"] for r in pipeline["rollouts"] if not r["placeholder"]] == [None] * 5
    failed_steps = [s for s in env["rollouts"][1]["spans"] if s["kind"] == "step" and s["failed"]]
    assert len(failed_steps) == 1
    assert placeholders(impossible) == [(1, placeholders(impossible)[0][1])]
    assert probe(impossible, "placeholders") == 1

    # JUnit: the same outcomes, in the words of the journal.
    cases = {case.get("classname"): case for case in ET.parse(junit_path).getroot().iter("testcase")}
    assert sorted(cases) == ["1_user_pipeline", "2_user_env", "3_impossible"]
    assert ET.parse(junit_path).getroot().get("failures") == "1"
    env_out = cases["2_user_env"].findtext("system-out") or ""
    assert "placeholder rollouts: 1, 4" in env_out
    assert f"  rollout 1: {placeholders(env)[0][1]}" in env_out
    pipeline_out = cases["1_user_pipeline"].findtext("system-out") or ""
    assert (
        "placeholder rollouts: 2\nrollout errors (1):\n  rollout 2: step raised ConnectionResetError"
        in pipeline_out
    )
    failure = cases["3_impossible"].find("failure")
    assert failure is not None
    assert failure.get("message") == "probe placeholders: observed 1, expected == 3"

    # The pictures, drawn from the same rollouts, one per scenario that ran.
    assert sorted(p.name for p in (folder / "plots").iterdir()) == [
        "1_user_pipeline.png",
        "2_user_env.png",
        "3_impossible.png",
    ]

    # Record takes the file as the run printed it, and the recording finds the user's parts from anywhere.
    recorded = tmp_path / "elsewhere" / "replay.yaml"
    recorded.parent.mkdir()
    code, out, err = cli(
        capsys,
        "chaos",
        "record",
        str(journal_path),
        "--scenario",
        "scenarios/2_user_env.yaml",
        "-o",
        str(recorded),
    )
    assert (code, err) == (0, ""), err
    spec = yaml.safe_load(recorded.read_text())
    assert spec["model"] == str(tmp_path / "scenarios" / "model")
    assert spec["python_path"] == [str(tmp_path / "scenarios")]
    # The fault fired where its targeting says, on every run: it is replayed as it was.
    assert [fault["when"] for fault in spec["faults"]] == [{"rollouts": [1, 4], "turns": [0]}]
    assert load_scenario(recorded).env_factory is not None
