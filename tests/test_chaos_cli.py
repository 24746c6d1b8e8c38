"""The chaos command line end to end, on real vLLM: exit codes, journals, record and replay."""

from __future__ import annotations

import configparser
import json
import shutil
from pathlib import Path

import pytest
import yaml

from harness.cli import main, record_scenario
from harness.reports import comparable_journal, load_journal

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "scenarios"
INVALID = sorted((Path(__file__).parent / "invalid_scenarios").glob("*.yaml"))

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
    assert gpu["extras"].split() == ["test", "vllm"]
    same_suite = (
        cpu["commands"].replace("--device cpu", "--device cuda").replace("{/}chaos{/}", "{/}chaos-gpu{/}")
    )
    assert gpu["commands"] == same_suite
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'vllm = ["vllm"]' in pyproject


@pytest.mark.slow
def test_a_deviating_scenario_exits_1_and_the_journal_shows_observed_against_expected(tmp_path: Path) -> None:
    scenario = tmp_path / "scenarios" / "impossible.yaml"
    scenario.parent.mkdir()
    scenario.write_text(IMPOSSIBLE)
    journal = tmp_path / "journal.json"
    junit = tmp_path / "junit.xml"
    assert main(["chaos", "run", str(scenario), "--journal", str(journal), "--junit", str(junit)]) == 1
    data = json.loads(journal.read_text())
    assert data["status"] == "deviated"
    probes = {p["probe"]: p for p in data["scenarios"][0]["probes"]}
    assert probes["placeholders"] == {
        "probe": "placeholders",
        "expected": "== 3",
        "observed": 1,
        "held": False,
    }
    assert probes["envs_unclosed"]["held"] is True
    assert 'failures="1"' in junit.read_text()


@pytest.mark.slow
def test_two_runs_give_the_same_journal_apart_from_timings_and_record_replays_the_failures(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "scenarios"
    folder.mkdir()
    for name in ("01_placeholders_keep_the_batch.yaml", "20_random_failures.yaml"):
        shutil.copy(SCENARIOS / name, folder / name)
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    assert (
        main(["chaos", "run", str(folder), "--journal", str(first), "--plots", str(tmp_path / "plots")]) == 0
    )
    assert main(["chaos", "run", str(folder), "--journal", str(second)]) == 0
    assert comparable_journal(load_journal(first)) == comparable_journal(load_journal(second))
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "01_placeholders_keep_the_batch.png",
        "20_random_failures.png",
    ]

    recorded = tmp_path / "replay" / "recorded.yaml"
    recorded.parent.mkdir()
    assert main(["chaos", "record", str(first), "--scenario", "20_random_failures", "-o", str(recorded)]) == 0
    spec = yaml.safe_load(recorded.read_text())
    assert all("probability" not in fault["when"] for fault in spec["faults"])
    replayed = tmp_path / "replayed.json"
    assert main(["chaos", "run", str(recorded), "--journal", str(replayed)]) == 0

    def failed_rollouts(journal: Path, title_prefix: str) -> list[tuple[int, str | None]]:
        result = next(
            s for s in json.loads(journal.read_text())["scenarios"] if s["title"].startswith(title_prefix)
        )
        return [(r["index"], r["error"]) for r in result["rollouts"] if r["placeholder"]]

    original = failed_rollouts(first, "Seeded random")
    assert original, "the random scenario must fail some rollouts for the round trip to mean anything"
    assert failed_rollouts(replayed, "Replay of") == original


def test_record_refuses_a_journal_with_no_fired_faults() -> None:
    with pytest.raises(ValueError, match="expected exactly one scenario with fault firings, found 0"):
        record_scenario({"scenarios": [{"file": "a.yaml", "firings": [], "spec": {}}]})


def test_pytest_collects_every_scenario_file_as_one_item() -> None:
    import subprocess
    import sys

    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", str(SCENARIOS)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout.splitlines()
    items = [line for line in listed if line.startswith("scenarios/")]
    assert sorted(items) == sorted(f"scenarios/{p.name}::{p.stem}" for p in SCENARIOS.glob("*.yaml"))
