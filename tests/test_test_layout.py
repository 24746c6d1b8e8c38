"""The test folders never take the name of one of the project's packages.

pytest puts ``tests/`` and every test folder on ``sys.path``. A folder there named like a project package
(``tests/harness``) becomes a namespace package of that name, and a process that imports the package
fresh from that path (a fork server's worker, with the project installed editable through an import
hook rather than a path) gets the test folder instead: ``No module named 'harness.faults.env'``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PROJECT_PACKAGES = {"gym_resilience", "harness"}


def test_no_test_folder_is_named_like_a_project_package() -> None:
    folders = {path.name for path in TESTS.rglob("*") if path.is_dir() and path.name != "__pycache__"}
    assert not folders & PROJECT_PACKAGES


def test_the_project_packages_import_as_themselves_with_every_test_folder_on_the_path(tmp_path: Path) -> None:
    # What a fresh worker process sees: every test folder first on sys.path, the checkout's root absent.
    folders = [TESTS, *(path for path in TESTS.rglob("*") if path.is_dir() and path.name != "__pycache__")]
    code = (
        "import sys, importlib\n"
        f"sys.path[:0] = {[str(folder) for folder in folders]!r}\n"
        f"root = {str(TESTS.parent)!r}\n"
        "sys.path = [p for p in sys.path if p not in ('', root)]\n"
        f"for name in {sorted(PROJECT_PACKAGES)!r}:\n"
        "    module = importlib.import_module(name)\n"
        "    print(name, getattr(module, '__file__', None))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    for line in done.stdout.splitlines():
        name, file = line.split(" ", 1)
        assert file.endswith(f"{name}/__init__.py"), line
