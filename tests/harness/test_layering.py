"""The harness's stages import only the stages before them: scenario <- faults <- run <- judge <- reports
<- cli. Read from each module's imports (``ast``), top-level and function-level alike."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[2] / "harness"
STAGES = ("scenario", "faults", "run", "judge", "reports", "cli")
TOP_LEVEL = {"__init__", "pytest_plugin", "jsonlines", "errors", "cluster", "netns"}


def imported_stages(path: Path) -> set[str]:
    """The harness stage packages a module imports (``harness.<stage>...``)."""
    stages = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
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
