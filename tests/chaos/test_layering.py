"""The harness's stages import only the stages before them: scenario <- faults <- run <- judge <- reports
<- cli, and no harness module imports itself back. Read from each module's imports (``ast``), top-level
and function-level alike; imports under ``if TYPE_CHECKING:`` never run, so the cycle check skips them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[2] / "harness"
STAGES = ("scenario", "faults", "run", "judge", "reports", "cli")
TOP_LEVEL = {"__init__", "pytest_plugin", "errors", "cluster", "netns"}
BASE = ("errors",)
"""Top-level modules every stage may import: they import no stage themselves."""


def module_name(path: Path, root: Path) -> str:
    """The dotted name of a module file under ``root``'s parent (``harness/run/__init__.py`` is
    ``harness.run``); a file elsewhere is named by its stem."""
    if not path.is_relative_to(root.parent):
        return path.stem
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, root: Path = HARNESS, *, type_checking: bool = True) -> set[str]:
    """Every dotted name a module imports, relative imports resolved against its package, with
    ``from a import b`` giving both ``a`` and ``a.b``; without ``type_checking``, none of the imports under
    ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    if not type_checking:
        for node in ast.walk(tree):
            test = node.test if isinstance(node, ast.If) else None
            if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
            ):
                skipped |= {id(inner) for statement in node.body for inner in ast.walk(statement)}
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join([*base, module] if module else base)
            names.add(module)
            names |= {f"{module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def imported_stages(path: Path, root: Path = HARNESS) -> set[str]:
    """The harness stage packages a module imports (``harness.<stage>...``)."""
    stages = set()
    for name in imported_names(path, root):
        parts = name.split(".")
        if parts[0] == "harness" and len(parts) > 1 and parts[1] in STAGES:
            stages.add(parts[1])
    return stages


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_imports_only_itself_and_the_stages_before_it(stage: str) -> None:
    allowed = set(STAGES[: STAGES.index(stage) + 1])
    modules = sorted((HARNESS / stage).glob("*.py"))
    wrong = {
        str(path.relative_to(HARNESS)): sorted(imported_stages(path) - allowed)
        for path in modules
        if imported_stages(path) - allowed
    }
    assert len(modules) > 1
    assert wrong == {}


def test_the_parser_finds_a_stage_import_in_a_function(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from harness.judge.verdict import judge\n    import harness.cli\n")
    assert imported_stages(module) == {"judge", "cli"}


def test_harness_holds_the_stage_packages_and_at_most_six_modules() -> None:
    modules = {path.stem for path in HARNESS.glob("*.py")}
    assert len(modules) <= 6
    assert modules <= TOP_LEVEL
    assert all((HARNESS / stage / "__init__.py").is_file() for stage in STAGES)


def test_the_parser_resolves_a_relative_import(tmp_path: Path) -> None:
    module = tmp_path / "harness" / "faults" / "m.py"
    module.parent.mkdir(parents=True)
    module.write_text("from ..judge import verdict\nfrom . import plan\n")
    assert imported_stages(module, tmp_path / "harness") == {"judge", "faults"}


@pytest.mark.parametrize("base", BASE)
def test_a_base_module_imports_no_stage(base: str) -> None:
    assert imported_stages(HARNESS / f"{base}.py") == set()


def import_cycle(root: Path) -> list[str] | None:
    """One cycle of runtime imports among the modules under ``root`` (``a -> b -> a``), or None."""
    modules = {module_name(path, root): path for path in root.rglob("*.py")}
    graph = {
        name: sorted(imported_names(path, root, type_checking=False) & modules.keys() - {name})
        for name, path in modules.items()
    }
    state: dict[str, str] = {}

    def visit(name: str, stack: list[str]) -> list[str] | None:
        state[name] = "open"
        stack.append(name)
        for other in graph[name]:
            if state.get(other) == "open":
                return [*stack[stack.index(other) :], other]
            if other not in state and (cycle := visit(other, stack)) is not None:
                return cycle
        stack.pop()
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name, [])) is not None:
            return cycle
    return None


def test_no_harness_module_imports_itself_back() -> None:
    assert import_cycle(HARNESS) is None


def test_the_cycle_check_finds_a_cycle_through_a_function_but_not_a_type_only_one(tmp_path: Path) -> None:
    root = tmp_path / "harness"
    (root / "run").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "run" / "__init__.py").write_text("")
    (root / "run" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from harness.run.b import B\n"
    )
    (root / "run" / "b.py").write_text("from harness.run import a\n")
    assert import_cycle(root) is None
    (root / "run" / "a.py").write_text("def f():\n    from .b import B\n")
    assert import_cycle(root) == ["harness.run.a", "harness.run.b", "harness.run.a"]
