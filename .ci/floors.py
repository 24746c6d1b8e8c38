"""Write a pip constraints file that pins every core dependency of pyproject.toml to its declared floor.

pip has no lowest-version resolution, so the ``min-deps`` tox environment installs with these
constraints to prove that the floors pyproject.toml declares are enough. Every core dependency must
have a plain ``>=`` floor: one without it fails here, so the floor cannot go untested.

Usage: python .ci/floors.py OUTPUT_FILE
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"

_FLOOR = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?>=(?P<version>[^,;\s]+)$")


def floors(pyproject: Path) -> list[str]:
    """``name==floor`` for every dependency in ``[project].dependencies``."""
    pins = []
    for requirement in tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]:
        match = _FLOOR.match(requirement.replace(" ", ""))
        if match is None:
            raise SystemExit(f"{requirement!r} in {pyproject}: a core dependency needs one plain '>=' floor")
        pins.append(f"{match['name']}=={match['version']}")
    return pins


if __name__ == "__main__":
    Path(sys.argv[1]).write_text("\n".join(floors(PYPROJECT)) + "\n", encoding="utf-8")
