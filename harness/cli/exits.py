"""What every ``gym-resilience`` command shares: exit codes, the one-line error, the chaos extra's check."""

from __future__ import annotations

import sys
from importlib import util

__all__ = ["CHAOS_EXTRA", "InvalidInput", "install_hint", "missing_extra", "say"]

EXIT_HELD, EXIT_DEVIATED, EXIT_INVALID, EXIT_INTERRUPTED = 0, 1, 2, 130

CHAOS_EXTRA = {"yaml": "PyYAML", "pydantic": "pydantic", "matplotlib": "matplotlib", "faker": "faker"}
"""The ``[chaos]`` extra of pyproject.toml: each package's import name and distribution name.

Only the core (gymnasium, tenacity) is imported with this module, so ``--help`` and ``--version`` work
on a core install; the commands check for the extra first, and import its packages where they use them.
"""


def install_hint(extra: str) -> str:
    """How to install ``extra``: from a package registry, and in a checkout of the repository."""
    registry, checkout = f"pip install 'gym-resilience[{extra}]'", f"pip install -e '.[{extra}]'"
    return f"{registry} (in a checkout of the repository: {checkout})"


def _installed(module: str) -> bool:
    """Whether ``module`` can be found, without importing it (a slow import like vLLM's stays for later)."""
    try:
        return util.find_spec(module) is not None
    except (ImportError, ValueError):  # an import hook that refuses it, a module without a spec
        return False


def missing_extra(extra: str, packages: dict[str, str], who_needs: str) -> str | None:
    """The line to print when a package of ``extra`` (import name -> distribution name) is not installed,
    after ``who_needs`` (``"the chaos harness needs"``); None when all are installed."""
    missing = [package for module, package in packages.items() if not _installed(module)]
    if not missing:
        return None
    return (
        f"gym-resilience: {who_needs} the [{extra}] extra ({', '.join(missing)} not installed): "
        f"{install_hint(extra)}"
    )


class InvalidInput(Exception):
    """An input or output path the command cannot use; the message is the whole line to print (internal)."""


def say(message: str) -> None:
    """A line telling a person what the command is doing, on stderr beside the progress view."""
    print(f"gym-resilience: {message}", file=sys.stderr, flush=True)
