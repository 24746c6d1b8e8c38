"""The scenario plugin is registered with every pytest run of every project that installs gym-resilience,
so it must collect nothing where a project did not opt in: a folder named ``scenarios`` of the project's
own YAML stays out of its test run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TEST_OK = "def test_ok():\n    assert sum([1, 2]) == 3\n"

# Not a scenario: an unrelated config file that happens to live in a folder named scenarios.
FOREIGN_YAML = "database: {host: localhost, port: 5432}\n"


def foreign_project(root: Path, ini: str) -> Path:
    """A project of someone else's with its own pytest.ini, a test and ``scenarios/foo.yaml``."""
    (root / "pytest.ini").write_text(ini, encoding="utf-8")
    (root / "test_ok.py").write_text(TEST_OK, encoding="utf-8")
    (root / "scenarios").mkdir()
    (root / "scenarios" / "foo.yaml").write_text(FOREIGN_YAML, encoding="utf-8")
    return root


def collected(project: Path, *args: str) -> list[str]:
    """The node ids ``pytest --collect-only -q`` lists in ``project``, with this interpreter (where
    gym-resilience is installed, its ``pytest11`` entry point included)."""
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    items = [line for line in listed.stdout.splitlines() if "::" in line]
    assert listed.returncode == (0 if items else 5), listed.stdout + listed.stderr  # 5: none collected
    return items


def test_a_project_that_did_not_opt_in_keeps_its_scenarios_yaml_out_of_its_test_run(tmp_path: Path) -> None:
    project = foreign_project(tmp_path, "[pytest]\n")

    assert collected(project) == ["test_ok.py::test_ok"]
    assert collected(project, "scenarios") == []  # not even when the folder is named on the command line


@pytest.mark.parametrize(
    ("ini", "args"),
    [
        ("[pytest]\ngym_resilience_scenarios = true\n", ()),
        ("[pytest]\n", ("-o", "gym_resilience_scenarios=true")),
    ],
    ids=["ini-file", "command-line"],
)
def test_a_project_that_opted_in_gets_each_scenarios_yaml_file_as_one_item(
    tmp_path: Path, ini: str, args: tuple[str, ...]
) -> None:
    project = foreign_project(tmp_path, ini)

    # No -p: the entry point loaded the plugin, as in every project that installs gym-resilience.
    assert sorted(collected(project, *args)) == ["scenarios/foo.yaml::foo", "test_ok.py::test_ok"]


def test_a_folder_named_scenarios_above_the_project_does_not_make_its_yaml_scenarios(tmp_path: Path) -> None:
    # A checkout inside ~/scenarios/: only the project's own scenarios/ folder holds scenario files.
    project = tmp_path / "scenarios" / "proj"
    project.mkdir(parents=True)
    foreign_project(project, "[pytest]\ngym_resilience_scenarios = true\n")
    (project / "configs").mkdir()
    (project / "configs" / "train.yaml").write_text(FOREIGN_YAML, encoding="utf-8")

    assert sorted(collected(project)) == ["scenarios/foo.yaml::foo", "test_ok.py::test_ok"]


def test_a_scenarios_folder_that_is_pytests_rootdir_is_the_projects(tmp_path: Path) -> None:
    # No configuration file, run inside the folder: pytest's rootdir is scenarios itself.
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    (scenarios / "foo.yaml").write_text(FOREIGN_YAML, encoding="utf-8")

    assert collected(scenarios, "-o", "gym_resilience_scenarios=true") == ["foo.yaml::foo"]
