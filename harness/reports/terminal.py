"""The live terminal view of a chaos run: a progress bar while scenarios run, then a summary.

On a TTY the bar is one line redrawn in place and statuses are colored; anywhere else (CI logs, a
file) every finished scenario gets its own plain line, so the log reads top to bottom.

A scenario's line gives the times of its two runs, the summary table's ``baseline`` and ``faulted``,
and apart from them the time the harness spent on what it started for the scenario (vLLM, the first
time; a Ray cluster), so that an engine's start is never taken for a slow scenario.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from harness.judge.results import RunJournal, ScenarioResult, Status
from harness.reports.text import deviation_line
from harness.scenario.messages import counted

__all__ = ["ProgressView"]

_COLORS: dict[Status, str] = {"held": "32", "deviated": "31", "invalid": "33", "error": "35"}
_TITLE_WIDTH = 48


class ProgressView:
    """Shows a chaos run as it happens, on ``stream`` (default ``sys.stderr``).

    Call ``start(total)`` once, ``scenario_started`` / ``scenario_finished`` around each scenario,
    and ``finish(journal)`` at the end for the summary table and every deviation.

    Args:
        stream: where to write; redrawn in place with ``\\r`` only if it is a TTY.
        color: ANSI colors; by default only on a TTY and only without ``NO_COLOR`` in the environment.
        width: characters in the progress bar.
        clock: seconds, monotonic; a scenario's time on the bar is measured with it.

    Example:
        >>> import io
        >>> view = ProgressView(io.StringIO())
        >>> view.start(15)
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        color: bool | None = None,
        width: int = 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._tty = _is_tty(self._stream)
        self._color = (self._tty and "NO_COLOR" not in os.environ) if color is None else color
        self._width = width
        self._clock = clock
        self._total = 0
        self._done = 0
        self._current: str | None = None
        self._started_at = 0.0
        self._line_open = False

    def start(self, total: int) -> None:
        """A run of ``total`` scenarios begins."""
        self._total = total
        self._done = 0
        if self._tty:
            self._redraw(f"{self._bar()} 0/{total}")

    def scenario_started(self, file: str, title: str) -> None:
        """Scenario ``file`` starts running (drawn only on a TTY; a CI log gets one line when it ends)."""
        self._current = file
        self._started_at = self._clock()
        if self._tty:
            self._redraw(f"{self._bar()} {self._done}/{self._total} {file} running: {_clip(title)}")

    def scenario_finished(self, result: ScenarioResult, *, setup: str = "") -> None:
        """Scenario ``result.file`` ended with ``result.status``.

        ``setup`` names what the harness started for it besides its two runs (``"vLLM's start on cpu"``),
        shown with the time it took: the scenario's time from start to end, less its runs' own.
        """
        self._done += 1
        measured = self._current == result.file
        elapsed = self._clock() - self._started_at if measured else 0.0
        self._current = None
        status = self._paint(result.status)
        times = _times(result, elapsed, setup)
        line = f"{self._bar()} {self._done}/{self._total} {result.file} {status} {times}"
        if self._tty:
            self._redraw(line)
        else:
            self._write(line + "\n")

    def finish(self, journal: RunJournal) -> None:
        """The run ended: the summary table, then every deviation and every error message."""
        if self._line_open:
            self._write("\n")
            self._line_open = False
        self._write("\n" + "\n".join(self._summary(journal)) + "\n")

    def _summary(self, journal: RunJournal) -> list[str]:
        header = ("file", "title", "status", "probes held", "faults fired", "baseline", "faulted")
        rows = [
            (
                result.file,
                _clip(result.title),
                result.status,
                f"{sum(probe.held for probe in result.probes)}/{len(result.probes)}",
                str(len(result.firings)),
                _seconds(result.baseline_s),
                _seconds(result.faulted_s),
            )
            for result in journal.scenarios
        ]
        widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]
        right = {3, 4, 5, 6}  # numbers line up on the right

        def render(row: Sequence[str], status: Status | None = None) -> str:
            cells = []
            for column, (cell, width) in enumerate(zip(row, widths, strict=True)):
                padded = cell.rjust(width) if column in right else cell.ljust(width)
                # Color after padding: escape codes would otherwise count as width.
                cells.append(self._paint(status, padded) if column == 2 and status else padded)
            return "  ".join(cells).rstrip()

        lines = [render(header), render(["-" * width for width in widths])]
        lines += [render(row, result.status) for row, result in zip(rows, journal.scenarios, strict=True)]

        deviations = [result for result in journal.scenarios if result.status == "deviated"]
        if deviations:
            lines += ["", "Deviations:"]
            for result in deviations:
                lines.append(f"  {result.file}")
                lines += [f"    {deviation_line(probe)}" for probe in result.deviations()]
                if not result.deviations() and result.message:
                    lines += [f"    {text}" for text in result.message.splitlines()]
        failures = [result for result in journal.scenarios if result.status in ("invalid", "error")]
        if failures:
            lines += ["", "Errors:"]
            for result in failures:
                lines.append(f"  {result.file} ({result.status})")
                lines += [f"    {text}" for text in (result.message or "(no message)").splitlines()]

        counts = [
            f"{sum(result.status == status for result in journal.scenarios)} {status}"
            for status in ("held", "deviated", "invalid", "error")
            if any(result.status == status for result in journal.scenarios)
        ]
        total = f" in {journal.total_s:.1f} s" if journal.total_s else ""
        lines += [
            "",
            f"{counted(len(journal.scenarios), 'scenario')}{total}: {', '.join(counts) or 'none run'}; "
            f"run {self._paint(journal.status)}",
        ]
        return lines

    def _bar(self) -> str:
        filled = self._width * min(self._done, self._total) // self._total if self._total > 0 else 0
        return f"[{'#' * filled}{'.' * (self._width - filled)}]"

    def _paint(self, status: Status | None, text: str | None = None) -> str:
        text = status if text is None else text
        if not self._color or status is None:
            return text or ""
        return f"\x1b[1;{_COLORS[status]}m{text}\x1b[0m"

    def _redraw(self, line: str) -> None:
        # \x1b[K clears what a longer previous line left behind.
        self._write(f"\r{line}\x1b[K")
        self._line_open = True

    def _write(self, text: str) -> None:
        self._stream.write(text)
        self._stream.flush()


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-like stream without isatty
        return False


def _clip(text: str, width: int = _TITLE_WIDTH) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


_SETUP_SHOWN_S = 1.0
"""Time outside a scenario's runs below which its line does not mention it, unless something was started
for it: temporary folders, a tool server and the like take a fraction of a second."""


def _times(result: ScenarioResult, elapsed: float, setup: str) -> str:
    """``baseline 1.7 s + faulted 0.3 s``, then ``; 98.7 s more for vLLM's start on cpu`` when the
    scenario took longer than its runs (``elapsed``: 0 when not measured); ``after 98.7 s`` for one
    that never got to its runs."""
    runs = result.baseline_s + result.faulted_s
    if runs <= 0:
        if elapsed <= 0:
            return "-"
        return f"after {elapsed:.1f} s" + (f" ({setup} included)" if setup else "")
    times = f"baseline {result.baseline_s:.1f} s + faulted {result.faulted_s:.1f} s"
    extra = elapsed - runs
    if extra >= 0.05 and (setup or extra >= _SETUP_SHOWN_S):
        times += f"; {extra:.1f} s more for {setup or 'setup'}"
    return times


def _seconds(value: float) -> str:
    # 0.0 means not measured (an invalid file never runs): a dash, not a fake "0.0 s".
    return f"{value:.1f} s" if value else "-"
