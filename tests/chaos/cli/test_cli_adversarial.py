"""The chaos command line under hostile input: random scenario files, random journals, random bytes, deep
nesting and huge numbers never make it raise, print a traceback or run unbounded; each bad input gets
exit code 2 and one line per problem naming the file (a scenario file's problems earliest first)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.cli import MAX_JOURNAL_BYTES, MAX_JOURNAL_NESTING, main
from harness.reports.journal import write_atomically
from harness.scenario.loader import load_scenario
from harness.scenario.spec import PROBE_NAMES as PROBES

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

BOUND_S = 30.0
"""A generous upper bound on one command: the point is that it ends, not how fast."""


@dataclass
class Outcome:
    code: int
    out: str
    err: str


def cli(*argv: str) -> Outcome:
    """``main(argv)`` in this process, with what it printed; it must return, whatever the input."""
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    assert time.monotonic() - start < BOUND_S
    outcome = Outcome(code, out.getvalue(), err.getvalue())
    assert "Traceback" not in outcome.out + outcome.err
    return outcome


def assert_validated(path: Path) -> None:
    """``chaos validate path`` says valid on stdout (0), or gives one line per problem on stderr (2), each
    naming the file, in the order of their lines in it."""
    outcome = cli("chaos", "validate", str(path))
    if outcome.code == 0:
        assert outcome.out.startswith(f"{path}: valid (")
        assert outcome.err == ""
        return
    assert outcome.code == 2
    lines = outcome.err.splitlines()
    assert lines
    prefix = f"invalid scenario: {path}"
    assert all(line.startswith(prefix) for line in lines)
    numbers = [int(match.group(1)) for line in lines if (match := re.match(r":(\d+)", line[len(prefix) :]))]
    assert numbers == sorted(numbers)


def assert_recorded(journal: Path, output: Path) -> None:
    """``chaos record`` writes a valid scenario (0) or gives one line naming the journal or output (2)."""
    with contextlib.suppress(FileNotFoundError):
        output.unlink()
    outcome = cli("chaos", "record", str(journal), "-o", str(output))
    if outcome.code == 0:
        assert outcome.out.startswith(f"wrote {output}: ")
        load_scenario(output)
    else:
        assert outcome.code == 2
        assert len(outcome.err.splitlines()) == 1
        assert outcome.err.startswith(
            (f"{journal}: cannot record a scenario: ", f"invalid scenario: {output}")
        )


# --- strategies -------------------------------------------------------------------------------------------

# No ':' anywhere: a pipeline or exception name with one would import a module of that name.
TEXT = st.text(alphabet="abcxyz_-. é\u2028", max_size=12)
WORDS = [
    *("title", "description", "tags", "seed", "batch", "engine", "runner", "faults", "expect", "probes"),
    *("target", "kind", "method", "exception", "message", "delay_s", "latency_s", "link", "endpoint"),
    *("server", "after_requests", "when", "rollouts", "turns", "attempts", "nth_call", "probability"),
    *("env", "network", "raise", "delay", "hang", "interrupt", "bad_output", "abort", "kill", "latency"),
    *("reset_peer", "timeout", "tool", "reset", "step", "close", "vllm", "served", "servers", "tasks"),
    *("word_game", "tool_use", "outcome", "completes", "raises", "error", "probe", "eq", "lte", "gte"),
    *("range", "is", "max_turns", "skip_failed_rollouts", "retry", "isolate_envs", "env_step_timeout_s"),
    *("n_samples_per_prompt", "max_failed_fraction", "retry_on", "ConnectionError", "KeyboardInterrupt"),
    *PROBES,
]
NUMBERS = st.one_of(
    st.integers(-3, 600),
    st.integers(),
    st.integers(min_value=2**63 - 2, max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1e-300, 3600.0, 3600.0001, 1e9, float("inf"), float("nan")]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT, st.sampled_from(WORDS))
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(WORDS) | TEXT, inner, max_size=5)
    ),
    max_leaves=25,
)


def choice(words: str) -> st.SearchStrategy[Any]:
    """Mostly one of ``words``, sometimes anything."""
    return st.sampled_from(words.split()) | VALUES


WHEN = st.fixed_dictionaries(
    {},
    optional={
        "rollouts": st.lists(NUMBERS, max_size=3),
        "turns": st.lists(NUMBERS, max_size=3),
        "attempts": st.lists(NUMBERS, max_size=2),
        "nth_call": st.lists(NUMBERS, max_size=2),
        "nth_connection": st.lists(NUMBERS, max_size=2),
        "probability": NUMBERS,
    },
)
FAULT = st.fixed_dictionaries(
    {"target": choice("env engine network")},
    optional={
        "kind": choice("raise delay hang interrupt bad_output abort kill latency reset_peer timeout"),
        "method": choice("reset step close"),
        "exception": choice("ConnectionError RuntimeError KeyboardInterrupt SystemExit EnvStepError Nope"),
        "delay_s": NUMBERS,
        "latency_s": NUMBERS,
        "link": choice("engine tool"),
        "endpoint": NUMBERS,
        "server": NUMBERS,
        "after_requests": NUMBERS,
        "when": WHEN | VALUES,
    },
)
PROBE = st.fixed_dictionaries(
    {"probe": st.sampled_from(sorted(PROBES)) | VALUES},
    optional={"eq": NUMBERS | VALUES, "lte": NUMBERS, "gte": NUMBERS, "range": st.lists(NUMBERS, max_size=3)},
)
RUNNER = st.dictionaries(
    st.sampled_from(
        [
            *("skip_failed_rollouts", "max_turns", "n_samples_per_prompt", "isolate_envs", "temperature"),
            *("env_step_timeout_s", "env_reset_timeout_s", "generation_timeout_s", "max_failed_fraction"),
            *("top_p", "retry", "nope"),
        ]
    ),
    NUMBERS
    | st.booleans()
    | st.none()
    | st.dictionaries(st.sampled_from(["attempts", "max_delay_s"]), NUMBERS),
    max_size=5,
)
SCENARIO = st.fixed_dictionaries(
    {"title": TEXT},
    optional={
        "seed": NUMBERS,
        "batch": st.fixed_dictionaries({}, optional={"env": choice("word_game tool_use"), "tasks": NUMBERS}),
        "engine": st.fixed_dictionaries({}, optional={"kind": choice("vllm served"), "servers": NUMBERS}),
        "runner": RUNNER | VALUES,
        "faults": st.lists(FAULT | VALUES, max_size=4),
        "probes": st.lists(PROBE | VALUES, max_size=3),
        "expect": st.fixed_dictionaries(
            {}, optional={"outcome": choice("completes raises"), "error": choice("ValueError Nope")}
        ),
        "tags": st.lists(TEXT, max_size=3) | VALUES,
    },
)
YAML_TEXT = st.text(alphabet="[]{}:,-&*!|>'\"#%@`?ab01 .~\n\t\u00e9\x85\ufeff", max_size=300)

FIRING = st.fixed_dictionaries(
    {},
    optional={
        "fault": NUMBERS,
        "rollout": NUMBERS | st.none(),
        "attempt": NUMBERS | st.none(),
        "turn": NUMBERS | st.none(),
        "kind": TEXT,
    },
)
RESULT = st.fixed_dictionaries(
    {},
    optional={
        "file": TEXT | VALUES,
        "spec": SCENARIO | VALUES,
        "firings": st.lists(FIRING | VALUES, max_size=4),
    },
)
JOURNAL = st.fixed_dictionaries({}, optional={"scenarios": st.lists(RESULT | VALUES, max_size=3)}) | VALUES


@pytest.fixture
def scenario_file(tmp_path: Path) -> Path:
    return tmp_path / "fuzzed.yaml"


@pytest.fixture
def journal_file(tmp_path: Path) -> Path:
    return tmp_path / "journal.json"


# --- fuzzing ----------------------------------------------------------------------------------------------


@FUZZ
@given(document=SCENARIO | VALUES)
def test_validate_answers_every_random_scenario_document_with_valid_or_one_line(
    scenario_file: Path, document: Any
) -> None:
    scenario_file.write_text(yaml.safe_dump(document, allow_unicode=True))
    assert_validated(scenario_file)


@FUZZ
@given(text=YAML_TEXT)
def test_validate_answers_random_yaml_text_with_valid_or_one_line(scenario_file: Path, text: str) -> None:
    scenario_file.write_text(text, encoding="utf-8")
    assert_validated(scenario_file)


@FUZZ
@given(data=st.binary(max_size=400))
def test_validate_answers_random_bytes_with_valid_or_one_line(scenario_file: Path, data: bytes) -> None:
    scenario_file.write_bytes(data)
    assert_validated(scenario_file)


@settings(FUZZ, max_examples=40)
@given(depth=st.integers(1, 5000), flow=st.booleans(), digits=st.integers(1, 6000))
def test_validate_answers_deep_nesting_and_huge_numbers_with_valid_or_one_line(
    scenario_file: Path, depth: int, flow: bool, digits: int
) -> None:
    nested = (
        "[" * depth + "1" + "]" * depth if flow else "".join(f"\n{'  ' * n}- " for n in range(depth)) + "1"
    )
    scenario_file.write_text(f"title: t\ntags: {nested}\nseed: {'9' * digits}\n")
    assert_validated(scenario_file)


@FUZZ
@given(journal=JOURNAL)
def test_record_answers_every_random_journal_with_a_scenario_or_one_line(
    journal_file: Path, tmp_path: Path, journal: Any
) -> None:
    journal_file.write_text(json.dumps(journal))
    assert_recorded(journal_file, tmp_path / "recorded.yaml")


@FUZZ
@given(data=st.binary(max_size=400))
def test_record_answers_random_bytes_with_one_line(journal_file: Path, tmp_path: Path, data: bytes) -> None:
    journal_file.write_bytes(data)
    assert_recorded(journal_file, tmp_path / "recorded.yaml")


# --- record: journals that are not journals ---------------------------------------------------------------


SPEC = {
    "title": "Flaky env on served engines",
    "seed": 3,
    "batch": {"env": "word_game", "tasks": 4},
    "engine": {"kind": "served", "servers": 2},
    "runner": {"skip_failed_rollouts": True, "max_turns": 2},
    "faults": [
        {"target": "env", "kind": "raise", "exception": "ConnectionError", "when": {"probability": 0.5}},
        {"target": "engine", "kind": "kill", "server": 1, "after_requests": 3},
        {"target": "network", "kind": "reset_peer", "link": "engine", "when": {"probability": 0.5}},
        {"target": "env", "kind": "delay", "when": {"rollouts": [0]}},
    ],
    "probes": [{"probe": "batch_size", "eq": 4}],
}


def firing(fault: int, rollout: int | None, attempt: int | None, turn: int | None) -> dict[str, Any]:
    return {
        "fault": fault,
        "kind": "raise",
        "target": "env",
        "rollout": rollout,
        "attempt": attempt,
        "turn": turn,
        "detail": "",
        "at_s": 0.5,
    }


def journal_with(firings: list[dict[str, Any]], spec: Any = None) -> dict[str, Any]:
    result = {"file": "scenarios/flaky.yaml", "title": SPEC["title"], "status": "held", "spec": spec or SPEC}
    return {"status": "held", "device": "cpu", "scenarios": [{**result, "firings": firings}]}


def test_record_targets_each_firing_and_keeps_faults_that_hit_no_rollout_as_they_were(tmp_path: Path) -> None:
    journal = tmp_path / "journal.json"
    firings = [firing(0, 1, 0, 1), firing(0, 3, 0, None), firing(0, 1, 0, 1), firing(1, None, None, None)]
    firings.append(firing(2, 2, 0, 0))  # the delay (fault 3) never fired: the replay leaves it out
    journal.write_text(json.dumps(journal_with(firings)))
    output = tmp_path / "recorded.yaml"
    outcome = cli("chaos", "record", str(journal), "-o", str(output))
    assert (outcome.code, outcome.out) == (0, f"wrote {output}: 4 faults\n")
    scenario = load_scenario(output)
    assert scenario.title == "Replay of: Flaky env on served engines"
    assert [fault.model_dump(exclude_defaults=True) for fault in scenario.faults] == [
        {
            "target": "env",
            "kind": "raise",
            "exception": "ConnectionError",
            "when": {"rollouts": [1], "attempts": [0], "turns": [1]},
        },
        {
            "target": "env",
            "kind": "raise",
            "exception": "ConnectionError",
            "when": {"rollouts": [3], "attempts": [0]},
        },
        {"target": "engine", "kind": "kill", "server": 1, "after_requests": 3},
        {
            "target": "network",
            "kind": "reset_peer",
            "link": "engine",
            "when": {"rollouts": [2], "attempts": [0], "turns": [0]},
        },
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal.json", "recorded.yaml"]


@pytest.mark.parametrize(
    ("journal", "reason"),
    [
        ([], "not a chaos journal: expected a JSON object at the top, got a list"),
        ({}, "not a chaos journal: scenarios: missing field"),
        ({"scenarios": 5}, "not a chaos journal: scenarios: input should be a valid list, got a number"),
        ({"scenarios": [[]]}, "not a chaos journal: scenarios[0]: expected an object, got a list"),
        (
            {"scenarios": [{"file": None, "firings": []}]},
            "not a chaos journal: scenarios[0].file: input should be a valid string, got null",
        ),
        (
            journal_with([firing(0, -1, 0, 0)]),
            "not a chaos journal: scenarios[0].firings[0].rollout: input should be greater than or equal "
            "to 0, got a number",
        ),
        (
            journal_with([{**firing(0, 1, 0, 0), "attempt": "0"}]),
            "not a chaos journal: scenarios[0].firings[0].attempt: input should be a valid integer, "
            "got a string",
        ),
        (
            journal_with([firing(7, 1, 0, 0)]),
            "not a chaos journal: scenarios[0].firings[0].fault: fault 7 does not exist: the spec has "
            "4 faults",
        ),
        (
            journal_with([firing(0, 1, 0, 0)], spec={"faults": []}),
            "not a chaos journal: scenarios[0].spec.title: expected a string, got null",
        ),
        (
            journal_with([firing(0, 1, 0, 0)], spec={"title": "t", "faults": ["raise"]}),
            "not a chaos journal: scenarios[0].spec.faults: expected a list of objects",
        ),
        (
            journal_with([]),
            "expected exactly one scenario with fault firings, found 0 (none); name one with --scenario",
        ),
    ],
)
def test_record_refuses_a_journal_of_the_wrong_shape_with_one_line_naming_the_field(
    tmp_path: Path, journal: Any, reason: str
) -> None:
    path = tmp_path / "journal.json"
    path.write_text(json.dumps(journal))
    outcome = cli("chaos", "record", str(path), "-o", str(tmp_path / "out.yaml"))
    assert (outcome.code, outcome.out) == (2, "")
    assert outcome.err == f"{path}: cannot record a scenario: {reason}\n"
    assert not (tmp_path / "out.yaml").exists()


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"\xff\xfe{}", "not UTF-8 text (byte 0xff at offset 0)"),
        (
            b"{",
            "not a chaos journal: invalid JSON: Expecting property name enclosed in double quotes: line 1 "
            "column 2 (char 1)",
        ),
        (
            b'{"scenarios": [' + b"9" * 5000 + b"]}",
            "not a chaos journal: invalid JSON: an integer of 5000 digits",
        ),
        (
            b"[" * 100_000 + b"]" * 100_000,
            f"not a chaos journal: the JSON nests deeper than {MAX_JOURNAL_NESTING} levels",
        ),
        (
            b'{"a": ' * (MAX_JOURNAL_NESTING + 1) + b"1" + b"}" * (MAX_JOURNAL_NESTING + 1),
            f"not a chaos journal: the JSON nests deeper than {MAX_JOURNAL_NESTING} levels",
        ),
    ],
)
def test_record_refuses_a_journal_that_is_not_json_with_one_line(
    tmp_path: Path, content: bytes, reason: str
) -> None:
    path = tmp_path / "journal.json"
    path.write_bytes(content)
    outcome = cli("chaos", "record", str(path), "-o", str(tmp_path / "out.yaml"))
    assert (outcome.code, outcome.err) == (2, f"{path}: cannot record a scenario: {reason}\n")


def test_record_refuses_a_fifo_a_folder_and_an_oversized_journal_without_reading_them(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    big = tmp_path / "big.json"
    with big.open("wb") as stream:
        stream.truncate(MAX_JOURNAL_BYTES + 1)  # sparse: nothing is written, the size is what counts
    expected = {
        fifo: "is a FIFO, not a regular file; give a journal",
        tmp_path: "is a directory, not a journal",
        big: "the file is 67,108,865 bytes; a journal is at most 67,108,864 bytes (64 MiB)",
        tmp_path / "missing.json": "no such file",
    }
    for path, reason in expected.items():
        outcome = cli("chaos", "record", str(path), "-o", str(tmp_path / "out.yaml"))
        assert (outcome.code, outcome.err) == (2, f"{path}: cannot record a scenario: {reason}\n")


def test_record_checks_its_output_path_before_reading_the_journal(tmp_path: Path) -> None:
    outcome = cli("chaos", "record", str(tmp_path / "missing.json"), "-o", str(tmp_path))
    assert (outcome.code, outcome.err) == (
        2,
        f"gym-resilience: -o {tmp_path}: is a folder; give a file name\n",
    )


# --- atomic writes ----------------------------------------------------------------------------------------


def test_write_atomically_replaces_the_file_instead_of_rewriting_it_in_place(tmp_path: Path) -> None:
    report = tmp_path / "reports" / "journal.json"
    write_atomically(report, b"first run\n")
    reader_of_the_old_file = tmp_path / "old-link"
    os.link(report, reader_of_the_old_file)  # what a reader that opened the old file still sees
    write_atomically(report, b"second run\n")
    assert report.read_bytes() == b"second run\n"
    assert reader_of_the_old_file.read_bytes() == b"first run\n"
    assert sorted(p.name for p in report.parent.iterdir()) == ["journal.json"]  # no partial file left


def test_write_atomically_leaves_no_partial_file_when_the_target_cannot_be_replaced(tmp_path: Path) -> None:
    target = tmp_path / "journal.json"
    target.mkdir()  # a folder cannot be replaced by a file
    (target / "keep").write_text("")
    with pytest.raises(IsADirectoryError):
        write_atomically(target, b"{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal.json"]
