"""``chaos record``: a scenario that replays exactly the faults a recorded run saw fire."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness.cli.exits import EXIT_HELD, InvalidInput
from harness.cli.run import check_file_target

__all__ = ["MAX_JOURNAL_BYTES", "MAX_JOURNAL_NESTING", "record_command", "record_scenario"]

MAX_JOURNAL_BYTES = 64 * 1024 * 1024
"""The largest journal ``record`` reads: a suite of 512-task scenarios writes a few MiB."""

MAX_JOURNAL_NESTING = 64
"""How deeply a journal's JSON may nest; a journal needs 8 levels (a fault's ``when`` in a spec)."""


def _reads() -> Mapping[type, Mapping[str, bool]]:
    """What ``record`` reads of a journal, with whether each field must be there (everything else in a
    journal is ignored): the journal's records of ``harness.judge.results``, checked by
    ``harness.reports.journal.strict_journal``. Imported on first use, as every reader of a journal is:
    this module imports without pydantic."""
    from harness.judge.results import FaultFiring, RunJournal, ScenarioResult

    return {
        RunJournal: {"scenarios": True},
        ScenarioResult: {"file": True, "spec": False, "firings": False},
        FaultFiring: {"fault": True, "rollout": False, "attempt": False, "turn": False},
    }


_RANDOM_TARGETING = ("probability", "nth_call", "nth_connection")
"""The targeting filters whose hits another run may not repeat: a ``probability`` draw (and its seed
depends on the fault's position, which a recorded file changes), and the counts of calls and connections
in the order they happen (``harness.scenario.spec.Targeting``)."""


def record_scenario(journal_data: Any, scenario_name: str | None = None) -> dict[str, Any]:
    """A scenario that replays exactly the faults a recorded run saw fire, rollout by rollout.

    A fault whose firings depend on chance or on the order of calls (``_RANDOM_TARGETING``) becomes one
    fault per rollout, attempt and turn it hit, so seeded-probability faults turn into a fixed, readable
    list; network faults too, since each request names its rollout. A firing that hit no rollout (a
    killed server, a request that named none, an engine call of a user pipeline) has no rollout to
    target: its fault is kept as it was, as is every other fault that fired, whose targeting already
    says where it fires. The faults keep their order, which decides the one that applies to a call.

    Raises:
        ValueError: ``journal_data`` is not a journal (the message names the field), or not exactly one
            of its scenarios (of those named ``scenario_name``) had faults fire.
    """
    from harness.reports.journal import strict_journal

    journal = strict_journal(journal_data, _reads())
    results = list(enumerate(journal.scenarios))
    if scenario_name is not None:
        results = _named(results, scenario_name)
    fired = [(n, r) for n, r in results if r.firings]
    if len(fired) != 1:
        names = ", ".join(r.file for _, r in fired) or "none"
        raise ValueError(
            f"expected exactly one scenario with fault firings, found {len(fired)} ({names}); "
            "name one with --scenario"
        )
    number, result = fired[0]
    spec = dict(result.spec)
    original = _recorded_faults(number, result)
    faults: list[dict[str, Any]] = []
    seen: set[str] = set()

    def keep(fault: dict[str, Any]) -> None:
        key = json.dumps(fault, sort_keys=True)
        if key not in seen:
            seen.add(key)
            faults.append(fault)

    for index, fault in enumerate(original):
        firings = [firing for firing in result.firings if firing.fault == index]
        if firings and not _fires_at_random(fault):
            keep(fault)
            continue
        for firing in firings:
            if firing.rollout is None or firing.attempt is None:
                keep(fault)
                continue
            when: dict[str, list[int]] = {"rollouts": [firing.rollout], "attempts": [firing.attempt]}
            if firing.turn is not None:
                when["turns"] = [firing.turn]
            keep({**fault, "when": when})
    spec["faults"] = faults
    spec["title"] = f"Replay of: {spec['title']}"
    spec["description"] = (
        f"Recorded from {result.file}: the faults that fired there, each one that fired by chance or by "
        "call order at the rollouts it hit."
    )
    return spec


def _fires_at_random(fault: dict[str, Any]) -> bool:
    """Whether the fault's targeting has a filter whose hits another run may not repeat."""
    when = fault.get("when")
    return isinstance(when, dict) and any(when.get(name) is not None for name in _RANDOM_TARGETING)


def _named(results: list[tuple[int, Any]], name: str) -> list[tuple[int, Any]]:
    """The results whose file is ``name``: the same path (as the run printed it, or resolved), else the
    same file name, with or without its suffix."""
    wanted = Path(name)
    same_path = [(n, r) for n, r in results if r.file == name or _same_file(Path(r.file), wanted)]
    if same_path:
        return same_path
    return [(n, r) for n, r in results if wanted.name in (Path(r.file).name, Path(r.file).stem)]


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError):  # a path that cannot be resolved (a symlink loop) names no file
        return False


def _recorded_faults(number: int, result: Any) -> list[dict[str, Any]]:
    """The faults of ``result``'s spec, checked to be what ``record_scenario`` reads."""
    from harness.reports.journal import json_type
    from harness.scenario.messages import counted

    at = f"not a chaos journal: scenarios[{number}].spec"
    if not isinstance(result.spec.get("title"), str):
        raise ValueError(f"{at}.title: expected a string, got {json_type(result.spec.get('title'))}")
    faults = result.spec.get("faults", [])
    if not isinstance(faults, list) or not all(isinstance(fault, dict) for fault in faults):
        raise ValueError(f"{at}.faults: expected a list of objects")
    for position, firing in enumerate(result.firings):
        if firing.fault >= len(faults):
            raise ValueError(
                f"not a chaos journal: scenarios[{number}].firings[{position}].fault: fault {firing.fault} "
                f"does not exist: the spec has {counted(len(faults), 'fault')}"
            )
    return faults


def _read_journal(path: Path) -> Any:
    """The JSON of the journal at ``path`` (``read_journal_file``).

    Raises:
        InvalidInput: it cannot be read as a journal; the message names the file and the reason.
    """
    from harness.reports.journal import read_journal_file

    try:
        return read_journal_file(path, max_bytes=MAX_JOURNAL_BYTES, max_nesting=MAX_JOURNAL_NESTING)
    except ValueError as exc:
        raise InvalidInput(f"{path}: cannot record a scenario: {exc}") from None


def record_command(args: argparse.Namespace) -> int:
    from harness.reports.journal import write_atomically
    from harness.scenario.loader import MAX_SCENARIO_BYTES, check_text
    from harness.scenario.messages import counted

    check_file_target("-o", args.output)
    data = _read_journal(args.journal)
    cannot = f"{args.journal}: cannot record a scenario"
    try:
        spec = record_scenario(data, args.scenario)
    except ValueError as exc:
        raise InvalidInput(f"{cannot}: {exc}") from None
    import yaml

    text = yaml.safe_dump(spec, sort_keys=False)
    raw = text.encode("utf-8")
    # What is written must load: checked first, so that a scenario the loader refuses is never written.
    faults = counted(len(spec["faults"]), "fault")
    if len(raw) > MAX_SCENARIO_BYTES:
        raise InvalidInput(
            f"{cannot}: its {faults} {'makes' if len(spec['faults']) == 1 else 'make'} {len(raw):,} bytes "
            f"of YAML, and a scenario file is at most {MAX_SCENARIO_BYTES:,} bytes; record a run whose "
            "random faults fired fewer times (fewer tasks or turns, a lower probability); "
            f"{args.output} was not written"
        )
    checked = check_text(text, file=args.output, folder=args.output.parent)
    if checked.problems:
        invalid = f"it would not be a valid scenario: {checked.problems[0]}"
        raise InvalidInput(f"{cannot}: {invalid}; {args.output} was not written")
    write_atomically(args.output, raw)
    print(f"wrote {args.output}: {faults}")
    return EXIT_HELD
