"""Write a pip constraints file that pins every core dependency of pyproject.toml, and every dependency
of the extras named, to its declared floor.

pip has no lowest-version resolution, so the ``min-deps`` tox environment installs with these
constraints to prove that the floors pyproject.toml declares are enough. Every dependency pinned must
have a plain ``>=`` floor, and a package listed twice the same floor: otherwise this fails, so no floor
goes untested.

Usage: python .ci/floors.py OUTPUT_FILE [EXTRA ...]
"""

from __future__ import annotations

import re
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"

_FLOOR = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?>=(?P<version>[^,;\s]+)$")


def floors(pyproject: Path, extras: Sequence[str] = ()) -> list[str]:
    """``name==floor`` for every dependency in ``[project].dependencies`` and in each extra named."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        if extra not in project["optional-dependencies"]:
            raise SystemExit(f"{pyproject} has no extra {extra!r}")
        requirements += project["optional-dependencies"][extra]
    pins: dict[str, str] = {}
    for requirement in requirements:
        match = _FLOOR.match(requirement.replace(" ", ""))
        if match is None:
            raise SystemExit(f"{requirement!r} in {pyproject}: a pinned dependency needs a '>=' floor")
        name = match["name"].lower().replace("_", "-")
        if pins.setdefault(name, match["version"]) != match["version"]:
            raise SystemExit(f"{name} in {pyproject}: floors {pins[name]} and {match['version']} disagree")
    return [f"{name}=={version}" for name, version in pins.items()]


if __name__ == "__main__":
    Path(sys.argv[1]).write_text("\n".join(floors(PYPROJECT, sys.argv[2:])) + "\n", encoding="utf-8")
