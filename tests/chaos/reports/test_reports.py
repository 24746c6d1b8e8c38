"""The reports of a chaos run: terminal view, JSON journal, JUnit XML and timeline PNGs, from one
hand-built journal of three scenarios (held, deviated twice, harness error).
"""

from __future__ import annotations

import dataclasses
import io
import json
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.judge.results import (
    EndpointSpan,
    FaultFiring,
    ProbeResult,
    RolloutSpan,
    RunJournal,
    ScenarioResult,
    TurnSpan,
)
from harness.reports import (
    ProgressView,
    comparable_journal,
    load_journal,
    plot_timeline,
    plot_timelines,
    write_journal,
    write_junit,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def turns(start: float, count: int, *, attempt: int = 0, fail_at: int | None = None) -> list[TurnSpan]:
    """The calls of one attempt: reset, then generate and step per turn, then close; ``fail_at`` is the
    turn whose step fails (the attempt stops there, as the runner does)."""
    spans = [TurnSpan("reset", None, attempt, start, start + 0.02, False)]
    at = start + 0.02
    for turn in range(count):
        spans.append(TurnSpan("generate", turn, attempt, at, at + 0.4, False))
        at += 0.4
        failed = turn == fail_at
        spans.append(TurnSpan("step", turn, attempt, at, at + 0.1, failed))
        at += 0.1
        if failed:
            break
    spans.append(TurnSpan("close", None, attempt, at, at + 0.01, False))
    return spans


def held_scenario() -> ScenarioResult:
    rollouts = [RolloutSpan(index, turns(0.05 * index, 3)) for index in range(8)]
    # Rollout 2's first attempt fails on turn 1, its retry completes.
    rollouts[2] = RolloutSpan(2, [*turns(0.1, 3, fail_at=1), *turns(1.3, 3, attempt=1)])
    return ScenarioResult(
        file="scenarios/env_step_raises.yaml",
        title="A step that raises is retried and the batch completes",
        status="held",
        probes=[
            ProbeResult("batch_size", "== 8", 8, True),
            ProbeResult("retries", ">= 1", 1, True),
            ProbeResult("identical_to_baseline", "is true", True, True),
            ProbeResult("wall_time_ratio", "<= 3", 1.4375, True),
        ],
        firings=[
            FaultFiring(0, "raise", "env", 2, 0, 1, "RuntimeError: injected fault", 1.02),
        ],
        rollouts=rollouts,
        outcome="completes",
        baseline_s=1.5,
        faulted_s=2.9,
        spec={
            "title": "A step that raises is retried and the batch completes",
            "faults": [{"target": "env", "kind": "raise", "method": "step", "delay_s": 0.5}],
            "probes": [{"probe": "wall_time_ratio", "lte": 3.0}],
        },
    )


def deviated_scenario() -> ScenarioResult:
    rollouts = [RolloutSpan(index, turns(0.03 * index, 2)) for index in range(6)]
    for index in (4, 5):
        rollouts[index] = RolloutSpan(
            index,
            [TurnSpan("reset", None, 0, 0.1, 0.12, False), TurnSpan("generate", 0, 0, 0.12, 0.9, True)],
            placeholder=True,
            error="EngineDeadError: every endpoint is dead",
        )
    return ScenarioResult(
        file="scenarios/kill_server.yaml",
        title="Killing the only served vLLM mid-batch",
        status="deviated",
        probes=[
            ProbeResult("batch_size", "== 6", 6, True),
            ProbeResult("placeholders", "<= 1", 2, False),
            ProbeResult("error_type", "== 'EngineDeadError'", None, False),
        ],
        firings=[
            FaultFiring(0, "kill", "engine", None, None, None, "SIGKILL vllm serve pid 4242", 0.85),
            FaultFiring(1, "latency", "network", None, None, None, "connection 3 +0.05 s per chunk", 0.4),
        ],
        rollouts=rollouts,
        outcome="completes",
        baseline_s=1.25,
        faulted_s=3.5,
    )


def error_scenario() -> ScenarioResult:
    return ScenarioResult(
        file="scenarios/tool_server_reset.yaml",
        title="The tool server resets connections",
        status="error",
        outcome="",
        message="harness error: OSError: [Errno 98] Address already in use\nwhile starting the fault proxy",
    )


def make_journal() -> RunJournal:
    return RunJournal(
        device="cpu",
        scenarios=[held_scenario(), deviated_scenario(), error_scenario()],
        started_at="2025-01-02T03:04:05",
        total_s=12.5,
    )


def retimed(journal: RunJournal, factor: float) -> RunJournal:
    """The same journal with every measurement scaled, as a second run of the suite would differ."""

    def scale_spans(rollout: RolloutSpan) -> RolloutSpan:
        spans = [
            dataclasses.replace(s, start_s=s.start_s * factor, end_s=s.end_s * factor) for s in rollout.spans
        ]
        return dataclasses.replace(rollout, spans=spans)

    scenarios = [
        dataclasses.replace(
            result,
            baseline_s=result.baseline_s * factor,
            faulted_s=result.faulted_s * factor,
            probes=[
                dataclasses.replace(p, observed=p.observed * factor) if p.probe == "wall_time_ratio" else p
                for p in result.probes
            ],
            # Concurrent rollouts reach their faults in another order in another run.
            firings=[dataclasses.replace(f, at_s=f.at_s * factor) for f in reversed(result.firings)],
            rollouts=[scale_spans(rollout) for rollout in result.rollouts],
        )
        for result in journal.scenarios
    ]
    return dataclasses.replace(journal, scenarios=scenarios, started_at="2025-06-07T08:09:10", total_s=99.0)


class FakeClock:
    def __init__(self, readings: list[float]) -> None:
        self._readings: Iterator[float] = iter(readings)

    def __call__(self) -> float:
        return next(self._readings)


class TtyStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_view(stream: io.StringIO, journal: RunJournal) -> None:
    view = ProgressView(stream, clock=FakeClock([0.0, 3.2, 10.0, 14.5, 20.0, 20.25]))
    view.start(len(journal.scenarios))
    for result in journal.scenarios:
        view.scenario_started(result.file, result.title)
        view.scenario_finished(result)
    view.finish(journal)


def test_progress_view_writes_one_plain_line_per_scenario_and_a_summary_when_not_a_tty() -> None:
    stream = io.StringIO()
    run_view(stream, make_journal())
    lines = stream.getvalue().splitlines()

    assert lines[:3] == [
        "[######..............] 1/3 scenarios/env_step_raises.yaml held baseline 1.5 s + faulted 2.9 s",
        "[#############.......] 2/3 scenarios/kill_server.yaml deviated baseline 1.2 s + faulted 3.5 s",
        "[####################] 3/3 scenarios/tool_server_reset.yaml error after 0.2 s",
    ]
    assert lines[4:9] == [
        "file                              title                                             status    "
        "probes held  faults fired  baseline  faulted",
        "--------------------------------  ------------------------------------------------  --------  "
        "-----------  ------------  --------  -------",
        "scenarios/env_step_raises.yaml    A step that raises is retried and the batch c...  held      "
        "        4/4             1     1.5 s    2.9 s",
        "scenarios/kill_server.yaml        Killing the only served vLLM mid-batch            deviated  "
        "        1/3             2     1.2 s    3.5 s",
        "scenarios/tool_server_reset.yaml  The tool server resets connections                error     "
        "        0/0             0         -        -",
    ]
    assert lines[9:] == [
        "",
        "Deviations:",
        "  scenarios/kill_server.yaml",
        "    probe placeholders: observed 2, expected <= 1",
        "    probe error_type: observed none, expected == 'EngineDeadError'",
        "",
        "Errors:",
        "  scenarios/tool_server_reset.yaml (error)",
        "    harness error: OSError: [Errno 98] Address already in use",
        "    while starting the fault proxy",
        "",
        "3 scenarios in 12.5 s: 1 held, 1 deviated, 1 error; run error",
    ]
    assert "\r" not in stream.getvalue()
    assert "\x1b" not in stream.getvalue()


def test_progress_view_redraws_one_colored_line_in_place_on_a_tty() -> None:
    stream = TtyStream()
    run_view(stream, make_journal())
    text = stream.getvalue()
    bar_part, summary = text.split("\n", 1)

    assert bar_part.count("\r") == 7  # start, then started and finished for each of 3 scenarios
    assert (
        "\r[######..............] 1/3 scenarios/env_step_raises.yaml \x1b[1;32mheld\x1b[0m "
        "baseline 1.5 s + faulted 2.9 s\x1b[K" in bar_part
    )
    assert bar_part.endswith(
        "\r[####################] 3/3 scenarios/tool_server_reset.yaml \x1b[1;35merror\x1b[0m after 0.2 s"
        "\x1b[K"
    )
    assert "\x1b[1;31mdeviated\x1b[0m" in summary
    assert "    probe placeholders: observed 2, expected <= 1\n" in summary


def test_progress_view_honours_an_explicit_color_choice() -> None:
    stream = TtyStream()
    view = ProgressView(stream, color=False, clock=FakeClock([0.0, 1.0]))
    view.start(1)
    view.scenario_started("scenarios/a.yaml", "A")
    view.scenario_finished(dataclasses.replace(held_scenario(), file="scenarios/a.yaml"))

    assert "\x1b[1;" not in stream.getvalue()


def test_a_progress_line_gives_the_runs_times_its_row_gives_and_the_engine_start_apart() -> None:
    first = dataclasses.replace(held_scenario(), file="scenarios/a.yaml", baseline_s=1.7, faulted_s=0.3)
    second = dataclasses.replace(held_scenario(), file="scenarios/b.yaml", baseline_s=1.1, faulted_s=0.6)
    failed = dataclasses.replace(error_scenario(), file="scenarios/c.yaml")
    journal = RunJournal(device="cpu", scenarios=[first, second, failed], total_s=205.2)
    stream = io.StringIO()
    # a.yaml: 102.9 s from start to end, vLLM's start in it; b.yaml: 0.4 s of temporary folders and such.
    view = ProgressView(stream, clock=FakeClock([0.0, 102.9, 103.0, 105.1, 106.0, 204.7]))
    view.start(3)
    for result, setup in ((first, "vLLM's start on cpu"), (second, ""), (failed, "vLLM's start on cpu")):
        view.scenario_started(result.file, result.title)
        view.scenario_finished(result, setup=setup)
    view.finish(journal)
    lines = stream.getvalue().splitlines()

    assert lines[:3] == [
        "[######..............] 1/3 scenarios/a.yaml held baseline 1.7 s + faulted 0.3 s; "
        "100.9 s more for vLLM's start on cpu",
        "[#############.......] 2/3 scenarios/b.yaml held baseline 1.1 s + faulted 0.6 s",
        "[####################] 3/3 scenarios/c.yaml error after 98.7 s (vLLM's start on cpu included)",
    ]
    row = next(line for line in lines if line.startswith("scenarios/a.yaml "))
    assert row.split()[-4:] == ["1.7", "s", "0.3", "s"]


def test_the_summary_counts_one_scenario_in_the_singular() -> None:
    stream = io.StringIO()
    view = ProgressView(stream, clock=FakeClock([0.0, 5.0]))
    view.start(1)
    view.scenario_started("scenarios/env_step_raises.yaml", "A")
    view.scenario_finished(held_scenario())
    view.finish(RunJournal(device="cpu", scenarios=[held_scenario()], total_s=5.0))

    assert stream.getvalue().splitlines()[-1] == "1 scenario in 5.0 s: 1 held; run held"


def test_journal_round_trips_through_its_json_file(tmp_path: Path) -> None:
    journal = make_journal()
    path = write_journal(journal, tmp_path / "out" / "journal.json")

    assert load_journal(path) == journal
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["status"] == "error"
    assert list(data) == sorted(data)
    assert path.read_text(encoding="utf-8").startswith('{\n  "device": "cpu",\n')


def test_journal_round_trips_endpoints_baseline_rollouts_and_the_endpoint_a_fault_hit(tmp_path: Path) -> None:
    journal = make_journal()
    journal.scenarios[1] = dataclasses.replace(
        journal.scenarios[1],
        firings=[dataclasses.replace(journal.scenarios[1].firings[0], endpoint=0)],
        baseline_rollouts=[RolloutSpan(index, turns(0.02 * index, 2)) for index in range(6)],
        endpoints=[EndpointSpan(0, down_s=[(0.85, 3.5)], failovers_s=[0.86, 0.9]), EndpointSpan(1)],
    )

    assert load_journal(write_journal(journal, tmp_path / "journal.json")) == journal


def test_comparable_journals_ignore_when_endpoints_were_down_but_not_how_many_there_were() -> None:
    first = make_journal()
    first.scenarios[1].endpoints = [EndpointSpan(0, down_s=[(0.85, 3.5)], failovers_s=[0.9]), EndpointSpan(1)]
    second = retimed(first, 1.0)
    second.scenarios[1].endpoints = [EndpointSpan(0, down_s=[(1.1, 2.0)], failovers_s=[1.2]), EndpointSpan(1)]
    third = retimed(first, 1.0)
    third.scenarios[1].endpoints = [EndpointSpan(0)]

    assert comparable_journal(first) == comparable_journal(second)
    assert comparable_journal(first) != comparable_journal(third)


def test_loading_a_file_that_is_not_a_journal_names_the_file_and_the_field(tmp_path: Path) -> None:
    data = make_journal().to_json()
    del data["scenarios"][1]["probes"][0]["held"]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data), encoding="utf-8")

    with pytest.raises(
        ValueError, match=r"broken\.json: not a chaos journal: scenarios\[1\]\.probes: .*held"
    ):
        load_journal(path)


def test_comparable_journals_of_two_runs_that_differ_only_in_timings_are_equal(tmp_path: Path) -> None:
    first = make_journal()
    second = retimed(first, 1.7)
    loaded_second = load_journal(write_journal(second, tmp_path / "second.json"))

    assert first.to_json() != second.to_json()
    assert comparable_journal(first) == comparable_journal(second)
    assert comparable_journal(first) == comparable_journal(json.loads((tmp_path / "second.json").read_text()))
    assert comparable_journal(first) == comparable_journal(loaded_second)


def test_comparable_journal_keeps_no_measured_field() -> None:
    text = json.dumps(comparable_journal(make_journal()))

    assert '_s"' not in text.replace('"delay_s"', "")
    assert "started_at" not in text
    assert "1.4375" not in text  # the wall time ratio's observed value
    assert '"probe": "wall_time_ratio"' in text


def test_comparable_journal_keeps_the_settings_in_a_scenario_spec() -> None:
    spec = comparable_journal(make_journal())["scenarios"][0]["spec"]

    assert spec["faults"] == [{"target": "env", "kind": "raise", "method": "step", "delay_s": 0.5}]


def test_comparable_journals_differ_when_a_probe_observed_another_value() -> None:
    first = make_journal()
    second = retimed(first, 1.0)
    deviated = second.scenarios[1]
    second.scenarios[1] = dataclasses.replace(
        deviated,
        probes=[
            dataclasses.replace(p, observed=3) if p.probe == "placeholders" else p for p in deviated.probes
        ],
    )

    assert comparable_journal(first) != comparable_journal(second)


def test_junit_xml_parses_with_the_right_counts_messages_and_classnames(tmp_path: Path) -> None:
    path = write_junit(make_journal(), tmp_path / "junit.xml")
    root = ET.parse(path).getroot()
    suite = root.find("testsuite")
    assert suite is not None
    cases = suite.findall("testcase")

    assert root.tag == "testsuites"
    assert suite.attrib == {
        "name": "gym_resilience chaos",
        "tests": "3",
        "failures": "1",
        "errors": "1",
        "skipped": "0",
        "time": "12.500",
        "timestamp": "2025-01-02T03:04:05",
    }
    assert [(case.get("classname"), case.get("name"), case.get("time")) for case in cases] == [
        ("env_step_raises", "A step that raises is retried and the batch completes", "4.400"),
        ("kill_server", "Killing the only served vLLM mid-batch", "4.750"),
        ("tool_server_reset", "The tool server resets connections", "0.000"),
    ]
    held, deviated, error = cases
    assert held.find("failure") is None and held.find("error") is None
    failure = deviated.find("failure")
    assert failure is not None
    assert failure.attrib == {
        "message": "probe placeholders: observed 2, expected <= 1; "
        "probe error_type: observed none, expected == 'EngineDeadError'",
        "type": "deviated",
    }
    assert failure.text == (
        "probe placeholders: observed 2, expected <= 1\n"
        "probe error_type: observed none, expected == 'EngineDeadError'"
    )
    error_element = error.find("error")
    assert error_element is not None
    assert error_element.attrib == {
        "message": "harness error: OSError: [Errno 98] Address already in use",
        "type": "error",
    }
    deviated_out = deviated.findtext("system-out") or ""
    assert "fault 0 (engine kill) at 0.850 s: SIGKILL vllm serve pid 4242" in deviated_out
    held_out = held.findtext("system-out") or ""
    assert (
        "fault 0 (env raise) at 1.020 s, rollout 2, attempt 0, turn 1: RuntimeError: injected fault"
        in held_out
    )


def test_junit_xml_stays_parseable_when_a_message_holds_control_characters(tmp_path: Path) -> None:
    journal = make_journal()
    journal.scenarios[2] = dataclasses.replace(
        journal.scenarios[2], message="boom \x1b[31mred\x1b[0m \x00 end"
    )
    root = ET.parse(write_junit(journal, tmp_path / "junit.xml")).getroot()
    error = root.find("testsuite/testcase/error")

    assert error is not None
    assert error.get("message") == "boom \ufffd[31mred\ufffd[0m \ufffd end"


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == PNG_SIGNATURE
    assert header[12:16] == b"IHDR"
    width, height = struct.unpack(">II", header[16:24])
    return width, height


def test_timeline_is_a_png_of_sensible_size(tmp_path: Path) -> None:
    import matplotlib.image

    path = plot_timeline(deviated_scenario(), tmp_path / "kill_server.png")
    width, height = png_size(path)
    pixels = matplotlib.image.imread(path)

    # 12 x 4.45 inches at 100 dpi: 7 rows of 0.32 inches, an inch of axis, a title line (0.26), three
    # lines of facts (0.17 each) and two rows of legend (0.22 each).
    assert (width, height) == (1200, 445)
    assert pixels.shape[:2] == (height, width)
    assert pixels.std() > 0.05  # something was drawn, not a blank canvas


def test_timeline_of_64_rollouts_grows_taller_but_stays_a_sensible_size(tmp_path: Path) -> None:
    result = held_scenario()
    result.rollouts = [RolloutSpan(index, turns(0.01 * index, 4)) for index in range(64)]
    width, height = png_size(plot_timeline(result, tmp_path / "wide.png"))

    assert width == 1200
    assert 1200 <= height <= 1600


def test_timelines_are_written_one_per_scenario_named_after_the_file(tmp_path: Path) -> None:
    journal = make_journal()
    journal.scenarios.append(dataclasses.replace(held_scenario(), file="scenarios/more/env_step_raises.yaml"))
    paths = plot_timelines(journal, tmp_path / "timelines")

    assert [path.name for path in paths] == [
        "env_step_raises.png",
        "kill_server.png",
        "tool_server_reset.png",
        "env_step_raises-2.png",
    ]
    assert all(png_size(path)[0] == 1200 for path in paths)


def test_importing_the_reports_does_not_import_matplotlib() -> None:
    code = "import sys, harness.reports; print('matplotlib' in sys.modules)"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout

    assert output.strip() == "False"
