"""Counts env creations and closes across threads and isolated worker processes.

Each event is one JSON line appended to a file (``O_APPEND``: one write per event), so envs built in
subprocesses (``isolate_envs``) are counted too. An env of a worker that was killed (a hung env past
its deadline) never logs its close; it counts as closed when its process is gone.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium

from gym_resilience import Task
from harness.jsonlines import append_json_line, read_json_lines

__all__ = ["EnvLedger", "LedgeredFactory"]


class _LedgeredEnv(gymnasium.Wrapper[Any, Any, Any, Any]):
    def __init__(self, env: gymnasium.Env[Any, Any], path: Path) -> None:
        super().__init__(env)
        self._path = path
        self._id = uuid.uuid4().hex
        append_json_line(path, {"event": "create", "id": self._id, "pid": os.getpid()})

    def close(self) -> None:
        try:
            self.env.close()
        finally:
            append_json_line(self._path, {"event": "close", "id": self._id, "pid": os.getpid()})


@dataclass(frozen=True)
class LedgeredFactory:
    """Wraps an env factory so every env it builds logs its creation and close. Picklable."""

    factory: Any
    path: Path

    def __call__(self, task: Task) -> gymnasium.Env[Any, Any]:
        return _LedgeredEnv(self.factory(task), self.path)


@dataclass(frozen=True)
class EnvLedger:
    """Reads a ledger file: how many envs were built, and how many were left open."""

    path: Path

    def factory(self, factory: Any) -> LedgeredFactory:
        return LedgeredFactory(factory, self.path)

    def _events(self) -> list[dict[str, Any]]:
        return read_json_lines(self.path)

    def created(self) -> int:
        return sum(1 for event in self._events() if event["event"] == "create")

    def unclosed(self) -> int:
        """Envs created and never closed whose process still runs (a killed worker took its env along)."""
        events = self._events()
        closed = {event["id"] for event in events if event["event"] == "close"}
        return sum(
            1
            for event in events
            if event["event"] == "create" and event["id"] not in closed and _alive(event["pid"])
        )


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
