"""Append-only JSON-lines logs that threads and worker processes can all write to.

Fault firings, call spans and the env ledger are written from the event loop, from env threads and
from isolated env processes; one ``write`` on an ``O_APPEND`` descriptor per record keeps lines whole.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["append_json_line", "read_json_lines"]


def append_json_line(path: Path, record: Mapping[str, Any]) -> None:
    """One record, one ``write`` on an ``O_APPEND`` descriptor: safe from any thread or process."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    """Every record in the file, in the order written; an absent file has none."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]
