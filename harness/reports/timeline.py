"""A timeline PNG per scenario: every rollout's engine and env calls in the faulted run, the faults
that hit them, the fault-free baseline beside them and the served endpoints' rotation.

Rows, top to bottom, time on x:

- one per served endpoint, when the result records them: a thin green line while it is in rotation, a
  red hatched bar while it is out, a triangle where a request it failed moved to another endpoint;
- a shared row for fault firings that hit no one rollout and no endpoint row;
- one per rollout. Generation and env calls are bars of two colors (reset and close are narrower than
  step, and darker), a failed call is outlined red, a retry (attempt 1 or later) is hatched and
  lighter, and a placeholder rollout's row is shaded. The baseline run's rollout is a thin grey bar
  under the faulted one, and a dashed grey line marks where the baseline's batch ended. On a Ray
  cluster each attempt's calls are topped by a thin strip in the color of the node its env ran on, and
  the row's label names the node of each attempt in order (``r3 w0>w1``: attempt 0 on worker node 0,
  attempt 1 on worker node 1), failed attempts included, those that never got to a call too.

Every call and every stretch out of rotation is drawn at least ``MIN_SPAN_FRACTION`` of the time axis
wide, centred on where it happened, so a 40 µs step next to seconds of generation still shows. Each
fault's firings are ``x`` markers on the row of the rollout they hit, and on the row of the endpoint
they hit. The title and the facts under it are wrapped to the figure's width and the legend sits
below the axes, so neither hides the other at any title length.

matplotlib is imported inside the functions, never at module import: the harness's other reports and
the command line start without it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from harness.judge.results import (
    EndpointSpan,
    RolloutSpan,
    RunJournal,
    ScenarioResult,
    Status,
    TurnSpan,
)
from harness.reports.text import deviation_line
from harness.reports.timeline_rows import (
    NodeName,
    Row,
    RowKey,
    count,
    endpoint_indices,
    faulted_end,
    firing_row_keys,
    last_moment,
    node_names,
    row_layout,
)

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.backend_bases import RendererBase
    from matplotlib.figure import Figure
    from matplotlib.patheffects import AbstractPathEffect

__all__ = ["MIN_SPAN_FRACTION", "plot_timeline", "plot_timelines", "timeline_figure"]

MIN_SPAN_FRACTION = 0.005
"""The narrowest a call or an outage is drawn, as a fraction of the time axis (about 5 pixels)."""

_GENERATE = "#4C72B0"
_ENV = "#DD8452"
_ENV_EDGE = "#A0522D"  # reset and close: the env's color, darker, so the legend tells them from step
_FAILED = "#D62728"
_PLACEHOLDER = "#D62728"
_BASELINE = "#A8A8A8"
_IN_ROTATION = "#2CA02C"
_OUT_OF_ROTATION = "#D62728"
_FAILOVER = "#FF7F0E"
_FIRING_COLORS = ("#111111", "#7B2CBF", "#2CA02C", "#8C564B", "#E377C2", "#17BECF", "#BCBD22")
_STATUS_COLORS: dict[Status, str] = {
    "held": "#2CA02C",
    "deviated": "#D62728",
    "invalid": "#B8860B",
    "error": "#9467BD",
}
_DPI = 100
_WIDTH_IN = 12.0
_TITLE_SIZE = 13.0
_FACTS_SIZE = 9.0
_LEGEND_COLUMNS = 4
# The facts start at the axes' left edge, after the row labels (at most a tenth of the width).
_TITLE_WIDTH, _FACTS_WIDTH = 0.94, 0.84


def plot_timeline(result: ScenarioResult, path: str | os.PathLike[str]) -> Path:
    """Draws the timeline of ``result``'s faulted run as a PNG at ``path`` and returns the path.

    A scenario with no recorded rollouts (an invalid file, a harness error before the run) still gets
    a figure, saying so and why.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    timeline_figure(result).savefig(path, format="png", dpi=_DPI)
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


def timeline_figure(result: ScenarioResult) -> Figure:
    """The timeline of ``result`` as a matplotlib figure on an Agg canvas, ready to draw or save.

    Its artists carry ids (``Artist.get_gid()``): ``r{index} {kind} turn {turn} attempt {attempt}``
    for a call, ``baseline r{index}``, ``baseline end``, ``endpoint {index} down``, ``endpoint {index}
    failovers``, ``fault {fault}`` for all of one fault's markers, and ``legend``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = row_layout(result)
    figure = Figure(figsize=(_WIDTH_IN, 4.0), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)  # the renderer measures the title to wrap it
    axes = figure.add_subplot()
    header_in = _titles(figure, axes, result)
    legend_rows = 0
    if rows:
        last = last_moment(result)
        _draw(axes, result, rows, last)
        legend_rows = _legend(figure, result)
        axes.set_xlim(0.0, last * 1.03)
        axes.set_ylim(len(rows) - 0.5, -0.5)  # row 0 on top
    else:
        reason = result.message.strip().splitlines()[0] if result.message.strip() else result.status
        axes.text(0.5, 0.5, f"no rollouts recorded\n{reason}", ha="center", va="center", wrap=True)
        axes.set_xticks([])
        axes.set_yticks([])
    both = "each run" if result.baseline_rollouts else "the faulted run"
    axes.set_xlabel(f"seconds since {both} started")
    per_row = 0.32 if len(rows) <= 16 else 0.2
    # The axes' ticks, label and margins take about an inch; the header and legend what they hold.
    height = per_row * len(rows) + 1.0 + header_in + 0.22 * legend_rows
    figure.set_size_inches(_WIDTH_IN, max(3.6, height))
    return figure


class _Lanes(NamedTuple):
    """Where a rollout row's bars sit, as offsets of their centres from the row's centre (down is
    positive) and heights, in rows."""

    calls: float
    calls_height: float
    baseline: float
    baseline_height: float


def _lanes(result: ScenarioResult) -> _Lanes:
    if result.baseline_rollouts:
        # The calls move up to leave a thin lane for the baseline underneath, inside the same row.
        return _Lanes(calls=-0.08, calls_height=0.6, baseline=0.32, baseline_height=0.12)
    return _Lanes(calls=0.0, calls_height=0.72, baseline=0.0, baseline_height=0.0)


def _draw(axes: Axes, result: ScenarioResult, rows: Sequence[Row], last: float) -> None:
    """Draws every row's content, the fault markers and the row labels."""
    row_of: dict[RowKey, int] = {(row.kind, row.of): number for number, row in enumerate(rows)}
    min_width = last * 1.03 * MIN_SPAN_FRACTION
    lanes = _lanes(result)

    for number, row in enumerate(rows):
        if row.placeholder:
            axes.axhspan(number - 0.5, number + 0.5, color=_PLACEHOLDER, alpha=0.1, linewidth=0, zorder=0)
        elif row.kind != "rollout":
            axes.axhspan(number - 0.5, number + 0.5, color="#888888", alpha=0.12, linewidth=0, zorder=0)

    for endpoint in result.endpoints:
        _endpoint_row(axes, row_of[("endpoint", endpoint.index)], endpoint, faulted_end(result), min_width)
    nodes = node_names(result)
    for rollout in result.rollouts:
        y = row_of[("rollout", rollout.index)] + lanes.calls
        for span in rollout.spans:
            _bar(axes, y, lanes.calls_height, rollout.index, span, min_width)
        _node_strips(axes, y - lanes.calls_height / 2, rollout, nodes, min_width)
    if result.baseline_rollouts:
        _baseline(axes, result.baseline_rollouts, row_of, lanes)
    _firings(axes, result, row_of, lanes, small=len(rows) > 32)
    _row_labels(axes, rows)


def _bar(axes: Axes, y: float, height: float, rollout: int, span: TurnSpan, min_width: float) -> None:
    color = {"generate": _GENERATE, "step": _ENV}.get(span.kind, _ENV_EDGE)
    retry = span.attempt > 0
    left, width, widened = _visible(span.start_s, span.end_s, min_width)
    (patch,) = axes.barh(
        y,
        width,
        left=left,
        height=height * 0.47 if span.kind in ("reset", "close") else height,
        color=color,
        alpha=0.55 if retry else 1.0,
        hatch="////" if retry else None,
        hatchcolor="#ffffff" if retry else None,
        edgecolor=_FAILED if span.failed else "#ffffff",
        linewidth=1.8 if span.failed else 0.5,
        # A widened call overlaps its neighbours: it goes on top of them, and a red outline on top of all.
        zorder=4 if span.failed else 3 if widened else 2,
    )
    patch.set_gid(f"r{rollout} {span.kind} turn {span.turn} attempt {span.attempt}")


def _node_strips(
    axes: Axes, top: float, rollout: RolloutSpan, names: dict[str, NodeName], min_width: float
) -> None:
    """Over each attempt's calls, a thin strip in the color of the node its env ran on."""
    by_attempt: dict[int, tuple[NodeName, list[TurnSpan]]] = {}
    for span in rollout.spans:
        if span.node is not None and span.node in names:
            by_attempt.setdefault(span.attempt, (names[span.node], []))[1].append(span)
    for attempt, (name, spans) in sorted(by_attempt.items()):
        start, end = min(span.start_s for span in spans), max(span.end_s for span in spans)
        left, width, _ = _visible(start, end, min_width)
        (patch,) = axes.barh(
            top - 0.05, width, left=left, height=0.07, color=name.color, linewidth=0, zorder=2
        )
        patch.set_gid(f"r{rollout.index} attempt {attempt} node {name.short}")


def _visible(start: float, end: float, min_width: float) -> tuple[float, float, bool]:
    """``(left, width, widened)`` of a bar for ``start .. end``: as it is, or ``min_width`` wide,
    centred on it (never left of 0), when it is narrower."""
    if end - start >= min_width:
        return start, end - start, False
    return max(0.0, (start + end - min_width) / 2), min_width, True


def _baseline(axes: Axes, rollouts: Sequence[RolloutSpan], row_of: dict[RowKey, int], lanes: _Lanes) -> None:
    """Each baseline rollout from its first call to its last, and where the baseline's batch ended."""
    ends = []
    for rollout in rollouts:
        if not rollout.spans:
            continue
        start = min(span.start_s for span in rollout.spans)
        end = max(span.end_s for span in rollout.spans)
        ends.append(end)
        (patch,) = axes.barh(
            row_of[("rollout", rollout.index)] + lanes.baseline,
            end - start,
            left=start,
            height=lanes.baseline_height,
            color=_BASELINE,
            linewidth=0,
            zorder=1,
        )
        patch.set_gid(f"baseline r{rollout.index}")
    if ends:
        line = axes.axvline(max(ends), color=_BASELINE, linestyle="--", linewidth=1.2, zorder=1)
        line.set_gid("baseline end")


def _endpoint_row(axes: Axes, row: int, endpoint: EndpointSpan, until: float, min_width: float) -> None:
    """In rotation until the faulted run ended, except where a bar says it was out; failovers below
    the centre and on top, so a fault's marker at the same moment does not hide them."""
    axes.hlines(row, 0.0, until, color=_IN_ROTATION, linewidth=2.0, alpha=0.7, zorder=1)
    for start, end in endpoint.down_s:
        left, width, _ = _visible(start, end, min_width)
        (patch,) = axes.barh(
            row,
            width,
            left=left,
            height=0.6,
            color="#F6C6C6",
            hatch="////",
            hatchcolor=_OUT_OF_ROTATION,
            edgecolor=_OUT_OF_ROTATION,
            linewidth=1.0,
            zorder=2,
        )
        patch.set_gid(f"endpoint {endpoint.index} down")
    if endpoint.failovers_s:
        markers = axes.scatter(
            endpoint.failovers_s,
            [row + 0.22] * len(endpoint.failovers_s),
            marker=">",
            s=45,
            color=_FAILOVER,
            edgecolors="#ffffff",
            linewidths=0.8,
            zorder=7,
        )
        markers.set_gid(f"endpoint {endpoint.index} failovers")


def _firings(
    axes: Axes, result: ScenarioResult, row_of: dict[RowKey, int], lanes: _Lanes, *, small: bool
) -> None:
    """Each fault's firings as ``x`` markers, one scatter per fault, centred on the calls' lane."""
    endpoints = endpoint_indices(result)
    by_fault: dict[int, list[tuple[float, float]]] = {}
    for firing in result.firings:
        for key in firing_row_keys(firing, endpoints) or [("shared", None)]:
            y = row_of[key] + (lanes.calls if key[0] == "rollout" else 0.0)
            by_fault.setdefault(firing.fault, []).append((firing.at_s, y))
    for fault, points in sorted(by_fault.items()):
        markers = axes.scatter(
            [x for x, _ in points],
            [y for _, y in points],
            marker="x",
            s=40 if small else 70,
            linewidths=2.2,
            color=_FIRING_COLORS[fault % len(_FIRING_COLORS)],
            zorder=6,
            path_effects=[_white_outline()],
        )
        markers.set_gid(f"fault {fault}")


def _row_labels(axes: Axes, rows: Sequence[Row]) -> None:
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
    # The endpoints and the shared row are the run's, not a rollout's: a darker line sets them apart.
    shared = sum(row.kind != "rollout" for row in rows)
    if 0 < shared < len(rows):
        axes.axhline(shared - 0.5, color="#999999", linewidth=1.0, zorder=1)
    axes.set_axisbelow(True)
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)


def _titles(figure: Figure, axes: Axes, result: ScenarioResult) -> float:
    """The title over the figure and the facts over the axes, wrapped to fit; returns their height
    in inches."""
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    width = figure.get_figwidth() * figure.dpi
    title = _wrap(
        f"{result.title}  ({result.status})".split(" "),
        " ",
        width * _TITLE_WIDTH,
        _TITLE_SIZE,
        True,
        renderer,
    )
    # parse_math off: a "$" in a title or an observed value is text, not the start of a formula.
    figure.suptitle("\n".join(title), fontsize=_TITLE_SIZE, fontweight="bold", parse_math=False)
    held = sum(probe.held for probe in result.probes)
    placeholders = sum(rollout.placeholder for rollout in result.rollouts)
    facts = [
        result.status,
        result.file,
        f"probes held {held}/{len(result.probes)}",
        count(len(result.firings), "fault firing"),
        count(placeholders, "placeholder"),
        f"baseline {result.baseline_s:.1f} s, faulted {result.faulted_s:.1f} s",
    ]
    facts_width = width * _FACTS_WIDTH
    lines = _wrap(facts, " | ", facts_width, _FACTS_SIZE, False, renderer)
    deviations = [deviation_line(probe) for probe in result.deviations()]
    for line in deviations[:3]:
        lines += _wrap(line.split(" "), " ", facts_width, _FACTS_SIZE, False, renderer, max_lines=2)
    if len(deviations) > 3:
        lines.append(f"... and {len(deviations) - 3} more")
    axes.set_title(
        "\n".join(lines),
        loc="left",
        fontsize=_FACTS_SIZE,
        color=_STATUS_COLORS[result.status],
        parse_math=False,
    )
    return 0.26 * len(title) + 0.17 * len(lines)


def _wrap(
    pieces: Sequence[str],
    separator: str,
    width_px: float,
    size: float,
    bold: bool,
    renderer: RendererBase,
    *,
    max_lines: int | None = None,
) -> list[str]:
    """``pieces`` joined by ``separator`` into lines no wider than ``width_px`` when drawn at ``size``
    points; a piece wider than a line on its own (a long path) is cut where it must be. Beyond
    ``max_lines`` the text is cut and ends in ``...``."""
    from matplotlib.font_manager import FontProperties

    font = FontProperties(size=size, weight="bold" if bold else "normal")

    def fits(text: str) -> bool:
        return renderer.get_text_width_height_descent(text, font, ismath=False)[0] <= width_px

    def longest_prefix(text: str) -> int:
        cut = len(text)
        while cut > 1 and not fits(text[:cut]):
            cut -= 1
        return cut

    lines: list[str] = []
    line = ""
    for piece in pieces:
        candidate = f"{line}{separator}{piece}" if line else piece
        if fits(candidate):
            line = candidate
            continue
        if line:
            lines.append(line)
        while not fits(piece):
            cut = longest_prefix(piece)
            lines.append(piece[:cut])
            piece = piece[cut:]
        line = piece
    lines.append(line)
    if max_lines is not None and len(lines) > max_lines:
        kept = lines[max_lines - 1]
        lines = [*lines[: max_lines - 1], kept[: longest_prefix(kept + "...") - 3] + "..."]
    return lines


def _legend(figure: Figure, result: ScenarioResult) -> int:
    """The legend, below the axes; returns how many rows of entries it has."""
    handles = _legend_handles(result)
    columns = min(len(handles), _LEGEND_COLUMNS)
    legend = figure.legend(
        handles=handles, loc="outside lower center", ncols=columns, fontsize=8, frameon=False
    )
    legend.set_gid("legend")
    return math.ceil(len(handles) / columns)


def _legend_handles(result: ScenarioResult) -> list[Artist]:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    spans = [span for rollout in result.rollouts for span in rollout.spans]
    handles: list[Artist] = [
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
    for name in node_names(result).values():
        label = f"env on {name.long}" if name.short == name.long else f"env on {name.short}: {name.long}"
        handles.append(Patch(facecolor=name.color, label=label))
    if result.baseline_rollouts:
        handles.append(Patch(facecolor=_BASELINE, label="rollout in the fault-free baseline"))
        handles.append(Line2D([], [], color=_BASELINE, linestyle="--", label="baseline batch ended"))
    if result.endpoints:
        handles.append(Line2D([], [], color=_IN_ROTATION, linewidth=2.0, label="endpoint in rotation"))
    if any(endpoint.down_s for endpoint in result.endpoints):
        handles.append(
            Patch(
                facecolor="#F6C6C6",
                hatch="////",
                hatchcolor=_OUT_OF_ROTATION,
                edgecolor=_OUT_OF_ROTATION,
                label="endpoint out of rotation",
            )
        )
    if any(endpoint.failovers_s for endpoint in result.endpoints):
        handles.append(
            Line2D(
                [],
                [],
                linestyle="none",
                marker=">",
                markersize=8,
                color=_FAILOVER,
                label="request failed over to another endpoint",
            )
        )
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
    return handles


def _white_outline() -> AbstractPathEffect:
    from matplotlib.patheffects import withStroke

    return withStroke(linewidth=4, foreground="white")
