"""The ``gym-resilience`` command line (``harness.cli:main``): the only place the harness prints and exits."""

from harness.cli.main import (
    CHAOS_EXTRA,
    MAX_JOURNAL_BYTES,
    MAX_JOURNAL_NESTING,
    install_hint,
    main,
    record_scenario,
)

__all__ = [
    "CHAOS_EXTRA",
    "MAX_JOURNAL_BYTES",
    "MAX_JOURNAL_NESTING",
    "install_hint",
    "main",
    "record_scenario",
]
