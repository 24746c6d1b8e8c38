"""The README and docs name the harness's modules where they are: every ``harness/...py`` path names a
file, every ``harness/<module path>.<name>`` and dotted ``harness.<module>[.<name>]`` imports (a stale name
from before a move fails here)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
PATH = re.compile(r"(?<![\w/.])harness/[\w/]+\.py\b")
PATH_NAME = re.compile(r"(?<![\w/.])harness/[\w/]+\.(?!py\b)[A-Za-z_]\w*")
DOTTED = re.compile(r"(?<![\w/.])harness(?:\.[A-Za-z_]\w*)+")


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a harness module, or a name reached from the longest module prefix of it."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for attribute in parts[end:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def named(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    return sorted(
        {(doc.name, match.rstrip(".")) for doc in DOCS for match in pattern.findall(doc.read_text())}
    )


@pytest.mark.parametrize(("doc", "path"), named(PATH))
def test_a_harness_path_in_the_docs_is_a_file(doc: str, path: str) -> None:
    assert (ROOT / path).is_file(), f"{doc} names {path}"


@pytest.mark.parametrize(("doc", "dotted"), named(DOTTED))
def test_a_dotted_harness_name_in_the_docs_imports(doc: str, dotted: str) -> None:
    assert resolves(dotted), f"{doc} names {dotted}"


@pytest.mark.parametrize(("doc", "path_name"), named(PATH_NAME))
def test_a_harness_path_and_name_in_the_docs_imports(doc: str, path_name: str) -> None:
    assert resolves(path_name.replace("/", ".")), f"{doc} names {path_name}"


def test_a_stale_name_does_not_resolve() -> None:
    assert PATH_NAME.findall("(`harness/replay.Bench`), harness/x.py") == ["harness/replay.Bench"]
    assert PATH.findall("see `harness/replay.py` and tests/chaos/x.py") == ["harness/replay.py"]
    assert not (ROOT / "harness/replay.py").exists()
    assert not resolves("harness.replay.Bench")
    assert not resolves("harness.run.bench.NoSuchName")
    assert resolves("harness.run.bench.Bench")
