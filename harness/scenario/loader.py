"""Load scenario files: YAML in, a :class:`~harness.scenario.compile.CompiledScenario` out, or every problem.

Loading runs once per file, in four steps, each in its own module:

1. read (``harness.scenario.source``): the bytes within bounds, the YAML with the line of every field;
2. validate (``harness.scenario.validate``): the data against the models of ``harness.scenario.spec``;
3. compile (``harness.scenario.compile``): ``runner:`` becomes a ``RunnerConfig``, exception names their
   classes, ``batch.env``, ``batch.tasks`` and ``pipeline`` the user's code, ``model`` a folder;
4. cross-check (``harness.scenario.rules``): every fault fits the engine, env, batch and runner it is
   meant to hit.

Every problem surfaces as a :class:`~gym_resilience.ScenarioError` naming the file, the line, the field
path (``faults[2].kind``) and what was expected (``harness.scenario.messages`` words them); a file's
problems are
all found in one pass and sorted by where they are in the file. A part with a problem is left out of
the later steps, so one mistake does not cause others. The library raises and never prints: the
command line prints every problem and exits with code 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import ScenarioError
from harness.scenario.compile import CompiledScenario, compile_parts
from harness.scenario.messages import field_path, show
from harness.scenario.names import resolve_exception
from harness.scenario.source import (
    MAX_NESTING,
    MAX_SCENARIO_BYTES,
    MAX_VALUES,
    SCENARIO_SUFFIXES,
    Locator,
    parse_yaml,
    read_input_file,
    read_scenario_text,
    scenario_files,
)
from harness.scenario.validate import validate_parts

__all__ = [
    "MAX_NESTING",
    "MAX_SCENARIO_BYTES",
    "MAX_VALUES",
    "SCENARIO_SUFFIXES",
    "Checked",
    "CompiledScenario",
    "Suite",
    "check_scenario",
    "check_text",
    "field_path",
    "load_scenario",
    "load_suite",
    "parse_scenario",
    "read_input_file",
    "resolve_exception",
    "scenario_files",
]


@dataclass(frozen=True)
class Checked:
    """One scenario file, loaded: its runnable form, or its problems (earliest in the file first)."""

    file: Path
    scenario: CompiledScenario | None
    problems: tuple[ScenarioError, ...] = ()


@dataclass
class Suite:
    """The scenario files some paths name, loaded: the valid ones in order, and every problem of the
    paths and files that are not, path by path and file by file."""

    scenarios: list[CompiledScenario] = field(default_factory=list)
    problems: list[ScenarioError] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.problems


def load_suite(paths: Sequence[str | Path]) -> Suite:
    """Loads every scenario file ``paths`` name (see :func:`scenario_files`), however many are invalid."""
    files, problems = scenario_files(paths)
    suite = Suite(problems=list(problems))
    for file in files:
        checked = check_scenario(file)
        if checked.scenario is not None:
            suite.scenarios.append(checked.scenario)
        suite.problems.extend(checked.problems)
    return suite


def check_scenario(path: str | Path) -> Checked:
    """Loads one scenario file: its runnable form, or every problem it has.

    A ``pipeline``, env factory or task loader module may sit next to it: its folder goes first on
    ``sys.path`` (see ``harness.scenario.compile``).
    """
    path = Path(path)
    try:
        text = read_scenario_text(path)
    except ScenarioError as problem:
        return Checked(path, None, (problem,))
    return check_text(text, file=path, folder=path.parent)


def check_text(text: str, *, file: str | Path = "<string>", folder: str | Path | None = None) -> Checked:
    """Loads scenario YAML given as text; ``file`` is the name problems give, ``folder`` where relative
    paths start and the user's modules are imported from (None: the working directory, nothing added
    to ``sys.path``)."""
    name = str(file)
    document = parse_yaml(text, name)
    if document.problems:
        return Checked(Path(file), None, tuple(document.problems))
    root, data = document.root, document.data
    if root is None:
        reason = "the file is empty; expected a mapping of scenario fields (title, faults, probes, ...)"
        return Checked(Path(file), None, (ScenarioError(file=name, field="", reason=reason),))
    if not isinstance(data, dict):
        reason = (
            "expected a mapping of scenario fields (title, faults, probes, ...) at the top level, "
            f"got {show(data)}"
        )
        error = ScenarioError(file=name, field="", reason=reason, line=root.start_mark.line + 1)
        return Checked(Path(file), None, (error,))
    parts, problems = validate_parts(data)
    compiled, more = compile_parts(parts, Path(file), None if folder is None else Path(folder))
    problems += more
    if compiled is not None and not problems:
        return Checked(Path(file), compiled)
    locate = Locator(root)
    located = sorted(
        ((locate(problem.anchor), order, problem) for order, problem in enumerate(problems)),
        key=lambda item: (item[0], item[1]),
    )
    errors = tuple(
        ScenarioError(file=name, field=field_path(problem.loc), reason=problem.reason, line=line)
        for (line, _column), _, problem in located
    )
    return Checked(Path(file), None, errors)


def load_scenario(path: str | Path) -> CompiledScenario:
    """Loads one scenario file (see :func:`check_scenario`).

    Raises:
        ScenarioError: the file cannot be read, is not YAML, or is not a valid scenario: its earliest
            problem (``str(error)`` is ``file:line at field: reason``); :func:`check_scenario` gives all.
    """
    return _only(check_scenario(path))


def parse_scenario(
    text: str, *, file: str = "<string>", folder: str | Path | None = None
) -> CompiledScenario:
    """Loads scenario YAML given as text (see :func:`check_text`).

    Raises:
        ScenarioError: its earliest problem.
    """
    return _only(check_text(text, file=file, folder=folder))


def _only(checked: Checked) -> CompiledScenario:
    if checked.scenario is None:
        raise checked.problems[0]
    return checked.scenario
