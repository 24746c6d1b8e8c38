"""The README's quick start runs as written: its Python block, saved to a file and run as a script,
generates on real vLLM. Without its ``if __name__ == "__main__":`` guard the script fails fast with the
typed error that names the fix, instead of vLLM's "see root cause above" from a second engine started
in the spawned child."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
GUARD = 'if __name__ == "__main__":\n'


def quick_start_block() -> str:
    """The first Python code block of the README's "Quick start" section."""
    section = README.read_text(encoding="utf-8").split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"^```python\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    assert match is not None, "the Quick start section has no Python block"
    return match[1]


def without_main_guard(source: str) -> str:
    """The same script with the guarded code at module level: the guard line gone, its body dedented."""
    head, guard, body = source.partition(GUARD)
    assert guard, "the script has no main guard to remove"
    return head + textwrap.dedent(body)


def run_script(source: str, directory: Path, name: str = "script.py") -> subprocess.CompletedProcess[str]:
    """Run ``source`` as a script file with this interpreter, as a user would run the pasted block."""
    path = directory / name
    path.write_text(source, encoding="utf-8")
    return subprocess.run(
        [sys.executable, str(path)], cwd=directory, capture_output=True, text=True, timeout=600, check=False
    )


def line_of(source: str, text: str) -> int:
    return next(number for number, line in enumerate(source.splitlines(), 1) if text in line)


@pytest.mark.slow
def test_the_readme_quick_start_runs_as_a_script_and_prints_the_batch_metrics(tmp_path: Path) -> None:
    result = run_script(quick_start_block(), tmp_path, "quick_start.py")

    assert result.returncode == 0, result.stderr[-4000:]
    metrics = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    assert metrics["rollout_errors"] == 0
    assert metrics["rollout_error_rate"] == 0
    assert metrics["batch_time_s"] > 0


@pytest.mark.slow
def test_the_quick_start_without_its_main_guard_fails_fast_with_the_error_naming_it(
    tmp_path: Path,
) -> None:
    source = without_main_guard(quick_start_block())
    result = run_script(source, tmp_path, "unguarded.py")

    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    call_line = line_of(source, "asyncio.run(main())")
    assert last_line.startswith(
        f"gym_resilience.errors.UnsupportedConfigError: __main__ guard: {tmp_path / 'unguarded.py'}, "
        f"line {call_line}, starts the engine from module-level code outside `{GUARD.strip()}`"
    ), last_line
    # Refused before vLLM started anything: no child ran the script again.
    assert "Engine core initialization failed" not in result.stderr
    assert "bootstrapping phase" not in result.stderr


# The check behind that error, on scripts that import only gym_resilience (no vLLM, so fast).

IMPORT = "from gym_resilience.engines.vllm import _unguarded_main_call\n"
REPORT = "print(__name__, _unguarded_main_call(), flush=True)\n"


def test_a_call_from_a_function_run_at_module_level_is_reported_at_that_line(tmp_path: Path) -> None:
    source = IMPORT + "def start():\n    " + REPORT + "\nstart()\n"
    result = run_script(source, tmp_path)

    assert result.returncode == 0, result.stderr
    assert (
        result.stdout
        == f"__main__ ('{tmp_path / 'script.py'}', {source.splitlines().index('start()') + 1})\n"
    )


@pytest.mark.parametrize("guard", ['if __name__ == "__main__":', "if '__main__' == __name__:"])
def test_a_call_under_the_main_guard_in_either_spelling_is_not_reported(tmp_path: Path, guard: str) -> None:
    result = run_script(f"{IMPORT}{guard}\n    {REPORT}", tmp_path)

    assert result.returncode == 0, result.stderr
    assert result.stdout == "__main__ None\n"


def test_a_script_run_again_by_spawn_is_reported_in_the_child_too(tmp_path: Path) -> None:
    source = (
        f"import multiprocessing\n{IMPORT}{REPORT}{GUARD}"
        "    process = multiprocessing.get_context('spawn').Process(target=print, kwargs={'flush': True})\n"
        "    process.start()\n"
        "    process.join()\n"
    )
    result = run_script(source, tmp_path)

    assert result.returncode == 0, result.stderr
    where = f"('{tmp_path / 'script.py'}', {line_of(source, 'print(__name__')})"
    assert result.stdout.splitlines() == [f"__main__ {where}", f"__mp_main__ {where}", ""]


def test_code_run_with_python_c_is_not_reported(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", IMPORT + REPORT],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout == "__main__ None\n"
