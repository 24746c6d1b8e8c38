"""Imported by the fork server only (it preloads this module last): imports the program's main module once.

Python 3.11's fork server means to preload ``__main__`` but never receives its path, so every worker would
import the program's main script again (a script that imports torch or ray pays seconds for that; see
docs/performance.md). Imported here once, before any worker forks, each worker finds it in place.
``gym_resilience.backends.process`` names the main module in an environment variable while it starts the
fork server; if importing it fails here, each worker imports it as before.
"""

from __future__ import annotations

import contextlib
import multiprocessing.spawn
import os

MAIN_VARIABLE = "_GYM_RESILIENCE_FORKSERVER_MAIN"
"""``path:<file>`` or ``name:<module>``: the main module the fork server imports; set only while it starts."""


def import_main(target: str) -> None:
    kind, _, value = target.partition(":")
    if kind == "path":
        multiprocessing.spawn.import_main_path(value)
    elif kind == "name":
        multiprocessing.spawn._fixup_main_from_name(value)  # type: ignore[attr-defined]


_target = os.environ.pop(MAIN_VARIABLE, None)
if _target:
    with contextlib.suppress(Exception):
        import_main(_target)
