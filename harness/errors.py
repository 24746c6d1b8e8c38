"""The chaos harness's errors: a scenario file that cannot be run."""

from __future__ import annotations

from gym_resilience.errors import GymResilienceError

__all__ = ["ScenarioError"]


class ScenarioError(GymResilienceError, ValueError):
    """Raised when a chaos scenario file is invalid; nothing of it was run.

    ``file`` names the file, ``field`` the path to the bad field (``faults[2].kind``), ``reason`` what was
    expected; ``line`` is the line of that field (or where YAML itself failed to parse), when known.
    """

    def __init__(self, *, file: str, field: str, reason: str, line: int | None = None) -> None:
        self.file = file
        self.field = field
        self.reason = reason
        self.line = line
        where = f"{file}:{line}" if line is not None else file
        at = f" at {field}" if field else ""
        super().__init__(f"{where}{at}: {reason}")
