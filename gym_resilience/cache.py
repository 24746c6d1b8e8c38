"""Where gym_resilience keeps what it builds or compiles: the tiny model, vLLM's and torch's caches.

One decision, in one place: ``$GYM_RESILIENCE_CACHE`` when set (tox points it at the project's
``.cache``), else ``~/.cache/gym_resilience``.
"""

from __future__ import annotations

import os
from pathlib import Path

from gym_resilience.errors import UnsupportedConfigError

__all__ = ["CACHE_ENV_VAR", "cache_dir"]

CACHE_ENV_VAR = "GYM_RESILIENCE_CACHE"


def cache_dir() -> Path:
    """Return gym_resilience's cache folder, creating it if needed.

    ``$GYM_RESILIENCE_CACHE`` wins when set and non-empty; otherwise ``~/.cache/gym_resilience``.
    The path is absolute, so it stays valid when the working directory changes: a relative value is
    taken from the working directory of the first call that reads it.

    Raises:
        UnsupportedConfigError: the folder cannot be made or used (a file is in the way, no permission,
            an unknown ``~user``); the error names the variable when it was set.
    """
    configured = os.environ.get(CACHE_ENV_VAR) or ""
    try:
        if configured:
            path = _absolute.setdefault(configured, Path(configured).expanduser().absolute())
        else:
            path = Path.home() / ".cache" / "gym_resilience"
        path.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError) as exc:
        where = f"${CACHE_ENV_VAR}={configured!r}" if configured else "~/.cache/gym_resilience"
        raise UnsupportedConfigError(
            f"cannot use {where} as gym_resilience's cache folder: {exc}", option=CACHE_ENV_VAR
        ) from exc
    return path


_absolute: dict[str, Path] = {}
"""Each value of the variable seen, made absolute once: a relative one must not move with the working
folder."""
