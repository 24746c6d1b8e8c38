"""Two scenario folders with a module of the same name: a process imports a module once, so the second
scenario would silently run the first one's. The loader says so instead, at the field that names it."""

from __future__ import annotations

import inspect
import secrets
from pathlib import Path

from harness.scenario.loader import load_suite

ENVS = """
import gymnasium
from gym_resilience import Task

WHO = {who!r}


class Env(gymnasium.Env):
    def reset(self, *, seed=None, options=None):
        return [{{"role": "user", "content": "hi"}}], {{}}

    def step(self, action):
        return [{{"role": "user", "content": "no"}}], 0.0, True, False, {{}}


def make_env(task):
    return Env()


def load_tasks():
    return [Task(prompt=[{{"role": "user", "content": "hi"}}], instance_id=WHO)]
"""


def scenario(folder: Path, module_file: str, module: str) -> Path:
    """A scenario in ``folder`` whose env and tasks come from ``module`` (the file ``module_file`` there)."""
    path = folder / module_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(ENVS.format(who=folder.name))
    file = folder / "s.yaml"
    file.write_text(
        f"title: {folder.name}\nbatch: {{env: '{module}:make_env', tasks: '{module}:load_tasks'}}\n"
    )
    return file


def test_a_module_another_scenarios_folder_imported_first_is_an_error(tmp_path: Path) -> None:
    name = f"envs_{secrets.token_hex(4)}"  # modules stay imported for the session: never reuse a name
    first = scenario(tmp_path / "a", f"{name}.py", name)
    second = scenario(tmp_path / "b", f"{name}.py", name)

    suite = load_suite([first, second, first])
    assert [inspect.getsourcefile(s.env_factory) for s in suite.scenarios if s.env_factory] == [
        str(tmp_path / "a" / f"{name}.py")
    ]
    reason = (
        f"cannot import module '{name}' from the scenario's folder: '{name}' was already imported from "
        f"{tmp_path / 'a' / name}.py (another scenario's folder, or an installed module of that name), not "
        f"from {tmp_path / 'b' / name}.py; a process holds one module of a name: rename one of them, or put "
        "it in a package of its own"
    )
    assert [str(problem) for problem in suite.problems] == [
        f"{second}:2 at batch.env: {reason}",
        f"{second}:2 at batch.tasks: {reason}",
    ]


def test_a_submodule_of_a_namespace_package_that_two_folders_share_is_an_error(tmp_path: Path) -> None:
    package = f"parts_{secrets.token_hex(4)}"  # no __init__.py: a namespace package, spread over folders
    first = scenario(tmp_path / "a", f"{package}/envs.py", f"{package}.envs")
    second = scenario(tmp_path / "b", f"{package}/envs.py", f"{package}.envs")

    suite = load_suite([first, second])
    assert [s.tasks[0].instance_id for s in suite.scenarios] == ["a"]
    assert len(suite.problems) == 2
    assert str(suite.problems[0]).startswith(
        f"{second}:2 at batch.env: cannot import module '{package}.envs' from the scenario's folder: "
        f"'{package}.envs' was already imported from {tmp_path / 'a' / package / 'envs.py'} "
    )


def test_modules_of_different_names_in_different_folders_load_in_any_order(tmp_path: Path) -> None:
    names = [f"envs_{secrets.token_hex(4)}" for _ in range(2)]
    first = scenario(tmp_path / "a", f"{names[0]}.py", names[0])
    second = scenario(tmp_path / "b", f"{names[1]}.py", names[1])
    # The first module again, after another folder was put on sys.path, from a python_path folder.
    (tmp_path / "c").mkdir()
    again = tmp_path / "c" / "s.yaml"
    again.write_text(first.read_text().replace("title: a", "title: c") + "python_path: [../a]\n")

    suite = load_suite([first, second, first, again])
    assert suite.problems == []
    assert [s.tasks[0].instance_id for s in suite.scenarios] == ["a", "b", "a"]
