"""A pytest plugin: ``pytest scenarios/`` collects each scenario YAML file as one test item.

Installing gym-resilience registers it with every pytest run (the ``pytest11`` entry point), so it is
opt-in: it collects only in a project whose pytest configuration sets ``gym_resilience_scenarios =
true`` (or a run given ``-o gym_resilience_scenarios=true``), and there only YAML files inside a folder
of the project named ``scenarios`` (pytest's rootdir or a folder below it). Every other project's test
run stays as it was.

Items of a session share one event loop and one ``Bench`` (the vLLM engines), closed when the session
ends. ``--chaos-device cuda`` runs vLLM on a GPU. When a collected scenario declares a Ray ``cluster``,
the session enters a loopback-only network namespace once collection is done, before any test runs
(see ``harness.run`` and ``harness.judge``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

__all__ = ["ScenarioItem"]

OPT_IN = "gym_resilience_scenarios"
"""The ini option (a bool, default false) that turns scenario collection on in a project."""

_BENCH = pytest.StashKey[tuple[asyncio.Runner, Any]]()
_NO_NAMESPACE = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        OPT_IN,
        "collect YAML files inside folders named scenarios as chaos scenarios",
        type="bool",
        default=False,
    )
    group = parser.getgroup("gym_resilience chaos")
    group.addoption(
        "--chaos-device", choices=("cpu", "cuda"), default="cpu", help="where vLLM runs for scenario items"
    )


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    config = parent.config
    if (
        config.getini(OPT_IN)
        and file_path.suffix in (".yaml", ".yml")
        and _in_a_scenarios_folder(file_path, config.rootpath)
    ):
        return ScenarioFile.from_parent(parent, path=file_path)
    return None


def _in_a_scenarios_folder(file_path: Path, rootpath: Path) -> bool:
    """Whether a folder named ``scenarios`` of the project holds ``file_path``: the project's root folder
    (pytest's rootdir) or one below it. Folders above the root are not the project's (a checkout inside
    ``~/scenarios/`` would collect every YAML file it has), nor is a file outside the root."""
    try:
        below = file_path.parent.relative_to(rootpath).parts
    except ValueError:
        return False
    return "scenarios" in (rootpath.name, *below)


def pytest_collection_finish(session: pytest.Session) -> None:
    if any(isinstance(item, ScenarioItem) and _declares_cluster(item.path) for item in session.items):
        from harness.run.clustered import enter_cluster_namespace

        refused = enter_cluster_namespace()
        if refused is not None:
            session.config.stash[_NO_NAMESPACE] = refused


def _declares_cluster(path: Path) -> bool:
    """Whether the scenario file at ``path`` declares a ``cluster`` (a file that cannot be read declares
    none: its item reports why)."""
    from harness.errors import ScenarioError
    from harness.scenario.source import parse_yaml, read_scenario_text

    try:
        data = parse_yaml(read_scenario_text(path), str(path)).data
    except ScenarioError:
        return False
    return isinstance(data, dict) and data.get("cluster") is not None


def _bench(config: pytest.Config) -> tuple[asyncio.Runner, Any]:
    if _BENCH not in config.stash:
        from harness.run.bench import Bench

        runner = asyncio.Runner()
        config.stash[_BENCH] = (runner, Bench(device=config.getoption("--chaos-device")))
    return config.stash[_BENCH]


def pytest_unconfigure(config: pytest.Config) -> None:
    if _BENCH in config.stash:
        runner, bench = config.stash[_BENCH]
        try:
            runner.run(bench.aclose())
        finally:
            runner.close()


class ScenarioFile(pytest.File):
    def collect(self) -> list[pytest.Item]:
        return [ScenarioItem.from_parent(self, name=self.path.stem)]


class ScenarioFailed(Exception):
    """Raised (inside pytest only) when a scenario deviated, was invalid, or could not run."""


class ScenarioItem(pytest.Item):
    def runtest(self) -> None:
        from harness.judge.verdict import run_scenario
        from harness.scenario.loader import check_scenario

        checked = check_scenario(self.path)
        if checked.scenario is None:  # every problem of the file, earliest first
            raise ScenarioFailed("\n".join(f"invalid scenario: {problem}" for problem in checked.problems))
        runner, bench = _bench(self.config)
        result = runner.run(run_scenario(checked.scenario, bench))
        if result.status != "held":
            lines = [f"{result.status}: {result.title}"]
            if result.message:
                lines.append(result.message)
            if checked.scenario.spec.cluster is not None and _NO_NAMESPACE in self.config.stash:
                lines.append(self.config.stash[_NO_NAMESPACE])
            lines += [
                f"probe {p.probe}: observed {p.observed!r}, expected {p.expected}"
                for p in result.deviations()
            ]
            raise ScenarioFailed("\n".join(lines))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        from harness.errors import ScenarioError

        if isinstance(excinfo.value, ScenarioFailed | ScenarioError):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"scenario: {self.path.name}"
