"""JUnit XML for CI: one test case per scenario file, failures for deviations, errors for the rest.

Only the attributes every common consumer reads are used (Jenkins, GitLab, GitHub test reporters,
Azure, pytest's own ``--junit-xml``): ``testsuites`` > ``testsuite`` (name, tests, failures, errors,
skipped, time, timestamp) > ``testcase`` (classname, name, time) with ``failure`` / ``error``
(message, type) and ``system-out``.
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from harness.judge.results import RunJournal, ScenarioResult
from harness.reports.journal import write_atomically
from harness.reports.text import deviation_line, firing_line

__all__ = ["SUITE_NAME", "junit_tree", "write_junit"]

SUITE_NAME = "gym_resilience chaos"

# XML 1.0 cannot hold most control characters, not even escaped; an exception message or an env's
# output may carry them (ANSI colors, NUL), and one of them would make the whole report unparseable.
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def junit_tree(journal: RunJournal) -> ET.Element:
    """The root (``testsuites``) of the JUnit document for ``journal``.

    A deviated scenario gets a ``failure``, an invalid or errored one an ``error``.
    """
    cases = [_testcase(result) for result in journal.scenarios]
    failures = sum(result.status == "deviated" for result in journal.scenarios)
    errors = sum(result.status in ("invalid", "error") for result in journal.scenarios)
    total_s = journal.total_s or sum(result.baseline_s + result.faulted_s for result in journal.scenarios)
    counts = {
        "tests": str(len(cases)),
        "failures": str(failures),
        "errors": str(errors),
        "skipped": "0",
        "time": f"{total_s:.3f}",
    }
    root = ET.Element("testsuites", {"name": SUITE_NAME, **counts})
    suite = ET.SubElement(root, "testsuite", {"name": SUITE_NAME, **counts})
    if journal.started_at:
        suite.set("timestamp", _clean(journal.started_at))
    properties = ET.SubElement(suite, "properties")
    ET.SubElement(properties, "property", {"name": "device", "value": _clean(journal.device)})
    suite.extend(cases)
    ET.indent(root)
    return root


def write_junit(journal: RunJournal, path: str | os.PathLike[str]) -> Path:
    """Writes the JUnit XML of ``journal`` (UTF-8, with an XML declaration) to ``path``, in one step (see
    ``write_atomically``)."""
    return write_atomically(path, ET.tostring(junit_tree(journal), encoding="utf-8", xml_declaration=True))


def _testcase(result: ScenarioResult) -> ET.Element:
    case = ET.Element(
        "testcase",
        {
            "classname": _clean(Path(result.file).stem),
            "name": _clean(result.title or result.file),
            "time": f"{result.baseline_s + result.faulted_s:.3f}",
        },
    )
    if result.status == "deviated":
        lines = [deviation_line(probe) for probe in result.deviations()]
        # Every deviation goes in the message too: many CI views show only the message.
        message = "; ".join(lines) or _first_line(result.message) or "the scenario deviated"
        failure = ET.SubElement(case, "failure", {"message": _clean(message), "type": "deviated"})
        failure.text = _clean("\n".join([*lines, *([result.message] if result.message else [])]))
    elif result.status in ("invalid", "error"):
        message = _first_line(result.message) or f"scenario {result.status}"
        error = ET.SubElement(case, "error", {"message": _clean(message), "type": result.status})
        error.text = _clean(result.message)
    out = ET.SubElement(case, "system-out")
    out.text = _clean(_system_out(result))
    return case


def _system_out(result: ScenarioResult) -> str:
    lines = [f"file: {result.file}", f"status: {result.status}"]
    if result.outcome:
        lines.append(f"outcome: {result.outcome}")
    lines.append(f"wall time: baseline {result.baseline_s:.3f} s, faulted {result.faulted_s:.3f} s")
    if result.probes:
        lines.append(f"probes ({sum(probe.held for probe in result.probes)}/{len(result.probes)} held):")
        lines += [
            f"  {'held    ' if probe.held else 'DEVIATED'} {deviation_line(probe)}" for probe in result.probes
        ]
    lines.append(f"fault firings ({len(result.firings)}):")
    lines += [f"  {firing_line(firing)}" for firing in result.firings]
    placeholders = [rollout.index for rollout in result.rollouts if rollout.placeholder]
    if placeholders:
        lines.append(f"placeholder rollouts: {', '.join(map(str, placeholders))}")
    failed = [rollout for rollout in result.rollouts if rollout.error is not None]
    if failed:
        lines.append(f"rollout errors ({len(failed)}):")
        lines += [f"  rollout {rollout.index}: {rollout.error}" for rollout in failed]
    return "\n".join(lines) + "\n"


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _clean(text: str) -> str:
    return _NOT_XML.sub("\ufffd", text)
