"""``chaos record`` re-targets only the faults whose firings another run may not repeat, keeps the others
as they were, and writes a scenario only once it is sure the loader takes it."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

from harness.cli import main, record_scenario
from harness.scenario.loader import MAX_SCENARIO_BYTES, load_scenario


def firing(fault: int, rollout: int | None, attempt: int | None, turn: int | None) -> dict[str, Any]:
    return {"fault": fault, "rollout": rollout, "attempt": attempt, "turn": turn}


def journal(spec: dict[str, Any], firings: list[dict[str, Any]]) -> dict[str, Any]:
    return {"scenarios": [{"file": "scenarios/x.yaml", "spec": spec, "firings": firings}]}


def record(path: Path, output: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["chaos", "record", str(path), "-o", str(output)])
    return code, out.getvalue(), err.getvalue()


RAISE = {"target": "env", "kind": "raise", "method": "step"}


def test_only_faults_that_fire_by_chance_or_by_call_order_are_targeted_at_each_firing() -> None:
    spec = {
        "title": "Mixed",
        "batch": {"env": "word_game", "tasks": 8},
        "runner": {"skip_failed_rollouts": True, "max_turns": 2, "retry": {"attempts": 2}},
        "faults": [
            {**RAISE, "when": {"rollouts": [1, 4], "turns": [0]}},
            {"target": "engine", "kind": "delay", "delay_s": 0.01},
            {**RAISE, "when": {"probability": 0.3}},
            {**RAISE, "when": {"nth_call": [2]}},
            {**RAISE, "when": {"rollouts": [7]}},  # never fired: left out
        ],
    }
    firings = [firing(0, 1, 0, 0), firing(1, 0, 0, 0), firing(2, 3, 0, 1), firing(0, 4, 0, 0)]
    firings += [firing(1, 2, 0, 1), firing(3, 2, 0, 1), firing(2, 5, 1, 0), firing(2, 3, 0, 1)]
    recorded = record_scenario(journal(spec, firings))
    assert recorded["faults"] == [
        {**RAISE, "when": {"rollouts": [1, 4], "turns": [0]}},  # where it fires is already fixed
        {"target": "engine", "kind": "delay", "delay_s": 0.01},  # every call: one fault, not one per call
        {**RAISE, "when": {"rollouts": [3], "attempts": [0], "turns": [1]}},
        {**RAISE, "when": {"rollouts": [5], "attempts": [1], "turns": [0]}},
        {**RAISE, "when": {"rollouts": [2], "attempts": [0], "turns": [1]}},
    ]


def test_a_recording_larger_than_a_scenario_file_may_be_is_refused_and_nothing_is_written(
    tmp_path: Path,
) -> None:
    spec = {
        "title": "Every step of 512 rollouts at random",
        "batch": {"env": "word_game", "tasks": 512},
        "runner": {"skip_failed_rollouts": True, "max_turns": 6},
        "faults": [{**RAISE, "when": {"probability": 0.9}}],
    }
    firings = [firing(0, rollout, 0, turn) for rollout in range(512) for turn in range(6)]
    path = tmp_path / "journal.json"
    path.write_text(json.dumps(journal(spec, firings)))
    output = tmp_path / "replay.yaml"
    code, out, err = record(path, output)
    assert (code, out) == (2, "")
    assert err.startswith(f"{path}: cannot record a scenario: its 3072 faults make ")
    assert err.endswith(
        f" bytes of YAML, and a scenario file is at most {MAX_SCENARIO_BYTES:,} bytes; record a run whose "
        f"random faults fired fewer times (fewer tasks or turns, a lower probability); {output} was not "
        "written\n"
    )
    assert not output.exists()
    # An existing file is left as it was.
    output.write_text("title: mine\n")
    assert record(path, output)[0] == 2
    assert output.read_text() == "title: mine\n"


def test_a_recording_the_loader_would_refuse_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    # The run's model folder is gone: the scenario would name a folder that does not exist.
    spec = {
        "title": "On a model since deleted",
        "model": str(tmp_path / "gone"),
        "batch": {"env": "word_game", "tasks": 4},
        "faults": [{**RAISE, "when": {"probability": 0.5}}],
    }
    path = tmp_path / "journal.json"
    path.write_text(json.dumps(journal(spec, [firing(0, 1, 0, 0)])))
    output = tmp_path / "replay.yaml"
    code, out, err = record(path, output)
    assert (code, out) == (2, "")
    assert err == (
        f"{path}: cannot record a scenario: it would not be a valid scenario: {output}:2 at model: model "
        f"folder '{tmp_path / 'gone'}' does not exist (looked for {tmp_path / 'gone'}); {output} was not "
        "written\n"
    )
    assert not output.exists()
    # Once it would load, it is written.
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / "config.json").write_text("{}")
    assert record(path, output)[:2] == (0, f"wrote {output}: 1 fault\n")
    assert load_scenario(output).faults[0].when.rollouts == [1]
