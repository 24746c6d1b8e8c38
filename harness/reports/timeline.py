"""A timeline PNG per scenario: every rollout's engine and env calls in the faulted run, and the faults
that hit them.

One row per rollout, time on x. Generation and env calls are bars of two colors (reset and close are
narrower than step, and darker), a failed call is outlined red, a retry (attempt 1 or later) is hatched
and lighter, each fault's firings are ``x`` markers on the row of the rollout they hit (engine and
network faults that hit no one rollout get their own row at the top), and a placeholder rollout's row
is shaded.

matplotlib is imported inside the functions, never at module import: the harness's other reports and
the command line start without it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from harness.reports.text import deviation_line
from harness.results import FaultFiring, RunJournal, ScenarioResult, Status, TurnSpan

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.patheffects import AbstractPathEffect

__all__ = ["plot_timeline", "plot_timelines"]

_GENERATE = "#4C72B0"
_ENV = "#DD8452"
_ENV_EDGE = "#A0522D"  # reset and close: the env's color, darker, so the legend tells them from step
_FAILED = "#D62728"
_PLACEHOLDER = "#D62728"
_FIRING_COLORS = ("#111111", "#7B2CBF", "#2CA02C", "#8C564B", "#E377C2", "#17BECF", "#BCBD22")
_STATUS_COLORS: dict[Status, str] = {
    "held": "#2CA02C",
    "deviated": "#D62728",
    "invalid": "#B8860B",
    "error": "#9467BD",
}
_SHARED_ROW = "engine/network"
_DPI = 100


def plot_timeline(result: ScenarioResult, path: str | os.PathLike[str]) -> Path:
    """Draws the timeline of ``result``'s faulted run as a PNG at ``path`` and returns the path.

    A scenario with no recorded rollouts (an invalid file, a harness error before the run) still gets
    a figure, saying so and why.
    """
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows, row_of = _rows(result)
    per_row = 0.32 if len(rows) <= 16 else 0.2
    figure = Figure(figsize=(12.0, max(3.6, 2.0 + per_row * len(rows))), dpi=_DPI, layout="constrained")
    axes = figure.add_subplot()
    _titles(figure, axes, result)
    if rows:
        end = _draw(axes, result, rows, row_of)
        _legend(figure, result)
        axes.set_xlim(0.0, end)
        axes.set_ylim(len(rows) - 0.5, -0.5)  # row 0 on top
    else:
        reason = result.message.strip().splitlines()[0] if result.message.strip() else result.status
        axes.text(0.5, 0.5, f"no rollouts recorded\n{reason}", ha="center", va="center", wrap=True)
        axes.set_xticks([])
        axes.set_yticks([])
    axes.set_xlabel("seconds since the faulted run started")
    figure.savefig(path, format="png", dpi=_DPI)
    return path


def plot_timelines(journal: RunJournal, directory: str | os.PathLike[str]) -> list[Path]:
    """One timeline per scenario in ``directory``, named after the scenario file (``kill_server.png``).

    Two files with the same stem in different folders get ``-2``, ``-3`` suffixes, in journal order.
    """
    directory = Path(directory)
    written: list[Path] = []
    taken: set[str] = set()
    for result in journal.scenarios:
        stem = Path(result.file).stem or "scenario"
        name, number = stem, 1
        while name in taken:
            number += 1
            name = f"{stem}-{number}"
        taken.add(name)
        written.append(plot_timeline(result, directory / f"{name}.png"))
    return written


class _Row(NamedTuple):
    label: str
    rollout: int | None  # None: the shared engine/network row
    placeholder: bool


def _rows(result: ScenarioResult) -> tuple[list[_Row], dict[int | None, int]]:
    """The rows top to bottom, and the row number of each rollout index (None: the shared row)."""
    placeholder = {rollout.index: rollout.placeholder for rollout in result.rollouts}
    indices = set(placeholder) | {firing.rollout for firing in result.firings if firing.rollout is not None}
    rows: list[_Row] = []
    if any(firing.rollout is None for firing in result.firings):
        rows.append(_Row(_SHARED_ROW, None, False))
    for index in sorted(indices):
        is_placeholder = placeholder.get(index, False)
        label = f"r{index} placeholder" if is_placeholder else f"r{index}"
        rows.append(_Row(label, index, is_placeholder))
    return rows, {row.rollout: number for number, row in enumerate(rows)}


def _draw(axes: Axes, result: ScenarioResult, rows: Sequence[_Row], row_of: dict[int | None, int]) -> float:
    """Draws spans, firings and row labels; returns where the time axis should end."""
    end = max(
        [result.faulted_s]
        + [span.end_s for rollout in result.rollouts for span in rollout.spans]
        + [firing.at_s for firing in result.firings]
    )
    end = end * 1.03 if end > 0 else 1.0
    # An instant call (a 1 ms reset in a 30 s run) would be invisible at its true width.
    min_width = end * 0.003

    for number, row in enumerate(rows):
        if row.placeholder:
            axes.axhspan(number - 0.5, number + 0.5, color=_PLACEHOLDER, alpha=0.1, linewidth=0, zorder=0)
        elif row.rollout is None:
            axes.axhspan(number - 0.5, number + 0.5, color="#888888", alpha=0.12, linewidth=0, zorder=0)

    for rollout in result.rollouts:
        for span in rollout.spans:
            _bar(axes, row_of[rollout.index], span, min_width)

    by_fault: dict[int, list[FaultFiring]] = {}
    for firing in result.firings:
        by_fault.setdefault(firing.fault, []).append(firing)
    for fault, firings in sorted(by_fault.items()):
        axes.scatter(
            [firing.at_s for firing in firings],
            [row_of[firing.rollout] for firing in firings],
            marker="x",
            s=70 if len(rows) <= 32 else 40,
            linewidths=2.2,
            color=_FIRING_COLORS[fault % len(_FIRING_COLORS)],
            zorder=5,
            path_effects=[_white_outline()],
        )

    font = 9.0 if len(rows) <= 24 else 7.0 if len(rows) <= 40 else 6.0
    axes.set_yticks(range(len(rows)), [row.label for row in rows], fontsize=font)
    for tick, row in zip(axes.get_yticklabels(), rows, strict=True):
        if row.placeholder:
            tick.set_color(_PLACEHOLDER)
            tick.set_fontweight("bold")
    axes.tick_params(axis="y", length=0)
    axes.grid(axis="x", color="#dddddd", linewidth=0.8, zorder=0)
    if len(rows) <= 40:
        for boundary in range(len(rows) - 1):
            axes.axhline(boundary + 0.5, color="#eeeeee", linewidth=0.6, zorder=0)
    axes.set_axisbelow(True)
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)
    return end


def _bar(axes: Axes, row: int, span: TurnSpan, min_width: float) -> None:
    color = {"generate": _GENERATE, "step": _ENV}.get(span.kind, _ENV_EDGE)
    retry = span.attempt > 0
    axes.barh(
        row,
        max(span.end_s - span.start_s, min_width),
        left=span.start_s,
        height=0.34 if span.kind in ("reset", "close") else 0.72,
        color=color,
        alpha=0.55 if retry else 1.0,
        hatch="////" if retry else None,
        hatchcolor="#ffffff" if retry else None,
        edgecolor=_FAILED if span.failed else "#ffffff",
        linewidth=1.8 if span.failed else 0.5,
        zorder=3 if span.failed else 2,  # a red outline stays on top of its neighbours' edges
    )


def _titles(figure: Figure, axes: Axes, result: ScenarioResult) -> None:
    figure.suptitle(f"{result.title}  ({result.status})", fontsize=13, fontweight="bold")
    held = sum(probe.held for probe in result.probes)
    placeholders = sum(rollout.placeholder for rollout in result.rollouts)
    facts = [
        result.status,
        result.file,
        f"probes held {held}/{len(result.probes)}",
        _count(len(result.firings), "fault firing"),
        _count(placeholders, "placeholder"),
        f"baseline {result.baseline_s:.1f} s, faulted {result.faulted_s:.1f} s",
    ]
    lines = [" | ".join(facts)]
    deviations = [deviation_line(probe) for probe in result.deviations()]
    lines += deviations[:3] + ([f"... and {len(deviations) - 3} more"] if len(deviations) > 3 else [])
    axes.set_title("\n".join(lines), loc="left", fontsize=9, color=_STATUS_COLORS[result.status])


def _legend(figure: Figure, result: ScenarioResult) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    spans = [span for rollout in result.rollouts for span in rollout.spans]
    handles: list[Patch | Line2D] = [
        Patch(facecolor=_GENERATE, label="generate"),
        Patch(facecolor=_ENV, label="env step"),
        Patch(facecolor=_ENV_EDGE, label="env reset / close (narrow)"),
    ]
    if any(span.attempt > 0 for span in spans):
        handles.append(
            Patch(
                facecolor=_ENV, alpha=0.55, hatch="////", hatchcolor="#ffffff", label="retry (attempt >= 1)"
            )
        )
    if any(span.failed for span in spans):
        handles.append(Patch(facecolor="#ffffff", edgecolor=_FAILED, linewidth=1.8, label="call failed"))
    if any(rollout.placeholder for rollout in result.rollouts):
        handles.append(Patch(facecolor=_PLACEHOLDER, alpha=0.15, label="placeholder rollout"))
    kinds: dict[int, tuple[str, int]] = {}
    for firing in result.firings:
        description, count = kinds.get(firing.fault, (f"{firing.target} {firing.kind}", 0))
        kinds[firing.fault] = (description, count + 1)
    for fault, (description, count) in sorted(kinds.items()):
        handles.append(
            Line2D(
                [],
                [],
                linestyle="none",
                marker="x",
                markersize=8,
                markeredgewidth=2.2,
                color=_FIRING_COLORS[fault % len(_FIRING_COLORS)],
                label=f"fault {fault}: {description} (x{count})",
            )
        )
    figure.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=False)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _white_outline() -> AbstractPathEffect:
    from matplotlib.patheffects import withStroke

    return withStroke(linewidth=4, foreground="white")
