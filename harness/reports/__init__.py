"""The reports of a chaos run, all read from the records in ``harness.judge.results``.

- ``ProgressView``: the live terminal view (a progress bar, then a summary table and every deviation);
- ``write_journal`` / ``load_journal`` / ``comparable_journal``: the JSON journal, and its form with every
  measurement dropped, so two runs of a suite can be diffed;
- ``write_junit``: JUnit XML for CI;
- ``plot_timeline`` / ``plot_timelines``: one PNG per scenario of every rollout's calls and the faults
  that hit them (matplotlib is imported only when a timeline is drawn).

Reports write to the stream or path they are given and never print on their own.
"""

from __future__ import annotations

from harness.reports.journal import comparable_journal, journal_from_json, load_journal, write_journal
from harness.reports.junit import junit_tree, write_junit
from harness.reports.terminal import ProgressView
from harness.reports.text import deviation_line, firing_line, format_value
from harness.reports.timeline import plot_timeline, plot_timelines

__all__ = [
    "ProgressView",
    "comparable_journal",
    "deviation_line",
    "firing_line",
    "format_value",
    "journal_from_json",
    "junit_tree",
    "load_journal",
    "plot_timeline",
    "plot_timelines",
    "write_journal",
    "write_junit",
]
