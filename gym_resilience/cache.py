"""Where gym_resilience keeps what it builds or compiles: the tiny model, vLLM's and torch's caches.

One decision, in one place: ``$GYM_RESILIENCE_CACHE`` when set (tox points it at the project's
``.cache``), else ``~/.cache/gym_resilience``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV_VAR", "cache_dir"]

CACHE_ENV_VAR = "GYM_RESILIENCE_CACHE"


def cache_dir() -> Path:
    """Return gym_resilience's cache folder, creating it if needed.

    ``$GYM_RESILIENCE_CACHE`` wins when set and non-empty; otherwise ``~/.cache/gym_resilience``.
    The path is absolute, so it stays valid when the working directory changes.
    """
    configured = os.environ.get(CACHE_ENV_VAR)
    path = Path(configured).expanduser() if configured else Path.home() / ".cache" / "gym_resilience"
    path = path.absolute()
    path.mkdir(parents=True, exist_ok=True)
    return path
