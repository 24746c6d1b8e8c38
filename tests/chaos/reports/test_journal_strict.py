"""A journal a user hands over is read strictly through the journal's one model: the records of
``harness.judge.results``, their own field types, and the fields a reader names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.judge.results import FaultFiring, RunJournal, ScenarioResult
from harness.reports.journal import load_journal, read_journal_file, strict_journal, write_journal

READS = {
    RunJournal: {"scenarios": True},
    ScenarioResult: {"file": True, "title": False, "firings": False},
    FaultFiring: {"fault": True, "rollout": False, "detail": False},
}


def written_journal(tmp_path: Path) -> Path:
    firings = [FaultFiring(1, "raise", "env", 3, 0, 1, "step raised OSError: gone", 0.5)]
    result = ScenarioResult(file="scenarios/x.yaml", title="X", status="held", firings=firings)
    return write_journal(RunJournal(device="cpu", scenarios=[result]), tmp_path / "journal.json")


def test_a_written_journal_reads_strictly_as_the_same_records_that_load_journal_builds(
    tmp_path: Path,
) -> None:
    path = written_journal(tmp_path)
    strict = strict_journal(read_journal_file(path, max_bytes=1 << 20, max_nesting=64), READS)
    [loaded] = load_journal(path).scenarios
    [read] = strict.scenarios
    assert (read.file, read.title) == (loaded.file, loaded.title)
    assert [(f.fault, f.rollout, f.detail) for f in read.firings] == [
        (f.fault, f.rollout, f.detail) for f in loaded.firings
    ]
    assert not hasattr(read.firings[0], "at_s")  # a field the reader did not name is not read


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        ({"file": 7}, "scenarios[0].file: input should be a valid string, got a number"),
        (
            {"file": "x", "firings": [{"fault": "1"}]},
            "scenarios[0].firings[0].fault: input should be a valid integer, got a string",
        ),
        (
            {"file": "x", "firings": [{"fault": 0, "rollout": -2}]},
            "scenarios[0].firings[0].rollout: input should be greater than or equal to 0, got a number",
        ),
        ({"file": "x", "firings": [{}]}, "scenarios[0].firings[0].fault: missing field"),
        ({"file": "x", "firings": {}}, "scenarios[0].firings: input should be a valid list, got an object"),
        ({"title": "x"}, "scenarios[0].file: missing field"),
    ],
)
def test_a_field_of_the_wrong_type_is_refused_with_its_path_and_the_records_own_rule(
    scenario: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as caught:
        strict_journal({"scenarios": [scenario]}, READS)
    assert str(caught.value) == f"not a chaos journal: {message}"


def test_fields_a_reader_may_leave_out_take_the_records_defaults_and_other_fields_are_ignored() -> None:
    journal = strict_journal({"scenarios": [{"file": "x", "firings": [{"fault": 0}], "unknown": 1}]}, READS)
    [scenario] = journal.scenarios
    # A record's own default where it has one (a rollout: None), else None (a title, a detail).
    assert (scenario.title, scenario.firings[0].rollout, scenario.firings[0].detail) == (None, None, None)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"[[[1]]]", "not a chaos journal: the JSON nests deeper than 2 levels"),
        (b'{"a": ' + b"7" * 101 + b"}", "not a chaos journal: invalid JSON: an integer of 101 digits"),
        (b"\xff", "not UTF-8 text (byte 0xff at offset 0)"),
    ],
)
def test_a_journal_file_is_read_within_its_limits(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "journal.json"
    path.write_bytes(content)
    with pytest.raises(ValueError) as caught:
        read_journal_file(path, max_bytes=1 << 20, max_nesting=2)
    assert str(caught.value) == reason


def test_a_journal_file_at_its_limits_is_read(tmp_path: Path) -> None:
    path = tmp_path / "journal.json"
    path.write_bytes(b'[["' + b"7" * 100 + b'"]]')
    assert read_journal_file(path, max_bytes=106, max_nesting=3) == [["7" * 100]]  # a value counts as a level
    with pytest.raises(ValueError, match="is 106 bytes; a journal is at most 105 bytes"):
        read_journal_file(path, max_bytes=105, max_nesting=3)
