"""``gym-resilience chaos run|validate|record``: the only place the harness prints and exits.

Exit codes: 0 every scenario held, 1 a scenario deviated (or the harness failed to run one), 2 invalid
input (a scenario file, a journal, an argument).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from gym_resilience import ScenarioError
from harness.spec import Scenario

__all__ = ["main", "record_scenario"]

EXIT_HELD, EXIT_DEVIATED, EXIT_INVALID = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gym-resilience", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    chaos = commands.add_parser("chaos", help="chaos scenarios against real vLLM generation")
    actions = chaos.add_subparsers(dest="action", required=True)

    run = actions.add_parser("run", help="run scenario files (or folders of them)")
    run.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    run.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where vLLM runs (default cpu)")
    run.add_argument("--journal", type=Path, help="write the JSON journal here")
    run.add_argument("--junit", type=Path, help="write JUnit XML here")
    run.add_argument("--plots", type=Path, help="write one timeline PNG per scenario into this folder")

    validate = actions.add_parser("validate", help="check scenario files without running them")
    validate.add_argument("paths", nargs="+", type=Path, metavar="PATH")

    record = actions.add_parser("record", help="turn the failures a run observed into a scenario file")
    record.add_argument("journal", type=Path, metavar="JOURNAL")
    record.add_argument("-o", "--output", type=Path, required=True, help="the scenario file to write")
    record.add_argument("--scenario", help="which scenario of the journal (its file name), if several")
    return parser


def _load(paths: Sequence[Path]) -> list[tuple[Path, Scenario]]:
    from harness.loader import load_scenarios

    return load_scenarios(paths)


def _validate(paths: Sequence[Path]) -> int:
    scenarios = _load(paths)
    for path, scenario in scenarios:
        print(f"{path}: valid ({scenario.title})")
    return EXIT_HELD


def _run(args: argparse.Namespace) -> int:
    from harness.replay import run_scenarios
    from harness.reports import ProgressView, plot_timelines, write_journal, write_junit
    from harness.results import RunJournal

    scenarios = _load(args.paths)
    view = ProgressView()
    view.start(len(scenarios))
    journal = RunJournal(device=args.device, started_at=datetime.now(UTC).isoformat(timespec="seconds"))
    start = time.perf_counter()
    journal.scenarios = asyncio.run(
        run_scenarios(
            scenarios,
            device=args.device,
            on_start=lambda path, scenario: view.scenario_started(str(path), scenario.title),
            on_finish=view.scenario_finished,
        )
    )
    journal.total_s = time.perf_counter() - start
    view.finish(journal)
    if args.journal:
        write_journal(journal, args.journal)
    if args.junit:
        write_junit(journal, args.junit)
    if args.plots:
        plot_timelines(journal, args.plots)
    return EXIT_HELD if journal.status == "held" else EXIT_DEVIATED


def record_scenario(journal_data: dict[str, Any], scenario_name: str | None = None) -> dict[str, Any]:
    """A scenario that replays exactly the faults a recorded run saw fire, rollout by rollout.

    Each env or engine fault that fired becomes one fault targeted at the rollout, attempt and turn it
    hit, so seeded-probability faults turn into a fixed, readable list. Network faults fire per
    connection, not per rollout; they are kept as they were (their seed replays them).
    """
    results = journal_data.get("scenarios", [])
    if scenario_name is not None:
        results = [r for r in results if Path(r["file"]).name in (scenario_name, f"{scenario_name}.yaml")]
    fired = [r for r in results if r.get("firings")]
    if len(fired) != 1:
        names = ", ".join(Path(r["file"]).name for r in fired) or "none"
        raise ValueError(
            f"expected exactly one scenario with fault firings, found {len(fired)} ({names}); "
            "name one with --scenario"
        )
    result = fired[0]
    spec = dict(result["spec"])
    original = spec.get("faults", [])
    faults: list[dict[str, Any]] = []
    for firing in result["firings"]:
        fault = dict(original[firing["fault"]])
        if fault.get("target") == "network":
            continue
        when: dict[str, list[int]] = {"rollouts": [firing["rollout"]], "attempts": [firing["attempt"]]}
        if firing.get("turn") is not None:
            when["turns"] = [firing["turn"]]
        fault["when"] = when
        if fault not in faults:
            faults.append(fault)
    faults += [fault for fault in original if fault.get("target") == "network"]
    spec["faults"] = faults
    spec["title"] = f"Replay of: {spec['title']}"
    spec["description"] = f"Recorded from {result['file']}: the faults that fired there, rollout by rollout."
    return spec


def _record(args: argparse.Namespace) -> int:
    from harness.loader import load_scenario

    try:
        import json

        data = json.loads(args.journal.read_text())
        spec = record_scenario(data, args.scenario)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"{args.journal}: cannot record a scenario: {exc}", file=sys.stderr)
        return EXIT_INVALID
    args.output.write_text(yaml.safe_dump(spec, sort_keys=False))
    load_scenario(args.output)  # what we wrote must be a valid scenario
    print(f"wrote {args.output}: {len(spec['faults'])} faults")
    return EXIT_HELD


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.action == "validate":
            return _validate(args.paths)
        if args.action == "record":
            return _record(args)
        return _run(args)
    except ScenarioError as error:
        print(f"invalid scenario: {error}", file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
