"""The timeline picture read through matplotlib's own renderer: where the title, facts and legend land,
how wide the narrowest call is drawn, and which row each fault marker, endpoint and baseline bar is on.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from matplotlib.collections import PathCollection

from harness.judge.results import (
    EndpointSpan,
    FaultFiring,
    ProbeResult,
    RolloutSpan,
    ScenarioResult,
    TurnSpan,
)
from harness.reports.timeline import MIN_SPAN_FRACTION, plot_timeline, timeline_figure

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle
    from matplotlib.transforms import Bbox, BboxBase


def rollout(index: int, start: float, *, generate_s: float = 1.0, step_s: float = 0.1) -> RolloutSpan:
    """reset, two turns of generate and step, close, from ``start``."""
    spans = [TurnSpan("reset", None, 0, start, start + 0.02, False)]
    at = start + 0.02
    for turn in range(2):
        spans.append(TurnSpan("generate", turn, 0, at, at + generate_s, False))
        spans.append(TurnSpan("step", turn, 0, at + generate_s, at + generate_s + step_s, False))
        at += generate_s + step_s
    spans.append(TurnSpan("close", None, 0, at, at + 0.01, False))
    return RolloutSpan(index, spans)


def scenario(title: str = "Four rollouts and a fault", **fields: object) -> ScenarioResult:
    result = ScenarioResult(
        file="scenarios/four.yaml",
        title=title,
        status="deviated",
        probes=[
            ProbeResult("batch_size", "== 4", 4, True),
            ProbeResult("placeholders", "<= 0", 1, False),
        ],
        firings=[FaultFiring(0, "raise", "env", 1, 0, 1, "RuntimeError: injected fault", 1.5)],
        rollouts=[rollout(index, 0.1 * index) for index in range(4)],
        baseline_s=2.0,
        faulted_s=2.5,
    )
    for name, value in fields.items():
        setattr(result, name, value)
    return result


def drawn(result: ScenarioResult) -> tuple[Figure, Axes]:
    figure = timeline_figure(result)
    figure.canvas.draw()
    (axes,) = figure.axes
    return figure, axes


def by_gid(figure: Figure, gid: str) -> list[Artist]:
    return list(figure.findobj(lambda artist: artist.get_gid() == gid))


def one_bar(figure: Figure, gid: str) -> Rectangle:
    (bar,) = by_gid(figure, gid)
    return bar  # type: ignore[return-value]


def markers(figure: Figure, gid: str) -> list[tuple[float, float]]:
    """Where the markers of the scatter with id ``gid`` are, in data coordinates, sorted."""
    import numpy as np

    (collection,) = by_gid(figure, gid)
    assert isinstance(collection, PathCollection)
    return sorted((float(x), float(y)) for x, y in np.asarray(collection.get_offsets()))


def text_box(figure: Figure, starts_with: str) -> Bbox:
    from matplotlib.text import Text

    (text,) = [t for t in figure.findobj(Text) if t.get_text().startswith(starts_with)]
    return text.get_window_extent()


def row_y(axes: Axes) -> dict[str, float]:
    """Each row's label and the y of its centre."""
    return {label.get_text(): y for label, y in zip(axes.get_yticklabels(), axes.get_yticks(), strict=True)}


def inside(box: BboxBase, outer: BboxBase) -> bool:
    return bool(box.x0 >= outer.x0 and box.y0 >= outer.y0 and box.x1 <= outer.x1 and box.y1 <= outer.y1)


TITLES = {
    10: "Kill a pod",
    80: "Connection resets between the tool env and its $server become placeholders, 80c",
    200: " ".join(["A served vLLM process killed mid-batch fails over to the other endpoint"] * 3)[:200],
}


@pytest.mark.parametrize(
    "title",
    [*TITLES.values(), "scenarios/" + "x" * 190],
    ids=["10 characters", "80 characters with dollars", "200 characters", "200 characters in one word"],
)
def test_title_facts_and_legend_never_overlap_and_stay_inside_the_figure(title: str) -> None:
    result = scenario(title)
    figure, axes = drawn(result)
    whole = figure.bbox
    title_box = text_box(figure, title[:8])
    facts_box = text_box(figure, "deviated | scenarios/four.yaml")
    (legend,) = figure.legends
    legend_box = legend.get_window_extent()

    for box in (title_box, facts_box, legend_box):
        assert inside(box, whole), (box, whole)
    assert not title_box.overlaps(legend_box)
    assert not facts_box.overlaps(legend_box)
    assert not title_box.overlaps(facts_box)
    assert not legend_box.overlaps(axes.get_window_extent())
    (suptitle,) = [t for t in figure.texts if t.get_text().startswith(title[:8])]
    assert suptitle.get_text().endswith("(deviated)")  # the status is wrapped with the title, never cut


def test_a_one_microsecond_step_between_ten_second_generations_is_drawn_at_least_the_minimum_width() -> None:
    spans = [
        TurnSpan("generate", 0, 0, 0.0, 10.0, False),
        TurnSpan("step", 0, 0, 10.0, 10.000001, False),
        TurnSpan("generate", 1, 0, 10.000001, 20.0, False),
        TurnSpan("step", 1, 0, 20.0, 20.000001, True),
    ]
    figure, axes = drawn(scenario(rollouts=[RolloutSpan(0, spans)], firings=[], faulted_s=20.0))
    minimum_px = MIN_SPAN_FRACTION * axes.get_window_extent().width
    step = one_bar(figure, "r0 step turn 0 attempt 0")
    failed = one_bar(figure, "r0 step turn 1 attempt 0")
    after = one_bar(figure, "r0 generate turn 1 attempt 0")

    assert minimum_px >= 4.0
    for bar in (step, failed):
        assert bar.get_window_extent().width >= minimum_px * 0.999
    # Centred on the call, and on top of the generation it overlaps.
    assert step.get_x() < 10.0 < 10.000001 < step.get_x() + step.get_width()
    assert step.get_zorder() > after.get_zorder()
    assert failed.get_x() + failed.get_width() > 20.000001


def test_a_network_fault_is_marked_on_the_rollout_it_hit_and_one_that_hit_none_on_the_shared_row() -> None:
    firings = [
        FaultFiring(0, "reset_peer", "network", 3, 0, 1, "tool POST /call: reset", 1.2),
        FaultFiring(0, "reset_peer", "network", None, None, None, "tool connection 0: reset", 0.3),
    ]
    figure, axes = drawn(scenario(firings=firings))
    rows = row_y(axes)

    assert list(rows) == ["engine/network", "r0", "r1", "r2", "r3"]
    assert markers(figure, "fault 0") == [(0.3, rows["engine/network"]), (1.2, rows["r3"])]


def test_a_rollout_firing_needs_no_shared_row() -> None:
    figure, axes = drawn(scenario())

    assert list(row_y(axes)) == ["r0", "r1", "r2", "r3"]
    assert markers(figure, "fault 0") == [(1.5, row_y(axes)["r1"])]


def test_each_served_endpoint_gets_a_row_with_its_outages_failovers_and_the_faults_that_hit_it() -> None:
    endpoints = [EndpointSpan(1), EndpointSpan(0, down_s=[(0.8, 1.9)], failovers_s=[0.81, 0.82])]
    kill = FaultFiring(0, "kill", "engine", 2, 0, 0, "killed server 0 at request 3", 0.8, endpoint=0)
    figure, axes = drawn(scenario(endpoints=endpoints, firings=[kill]))
    rows = row_y(axes)
    down = one_bar(figure, "endpoint 0 down")

    assert list(rows) == ["endpoint 0 (2 failovers)", "endpoint 1", "r0", "r1", "r2", "r3"]
    assert (down.get_x(), down.get_x() + down.get_width()) == pytest.approx((0.8, 1.9))
    assert down.get_y() < rows["endpoint 0 (2 failovers)"] < down.get_y() + down.get_height()
    failovers = markers(figure, "endpoint 0 failovers")
    assert [x for x, _ in failovers] == [0.81, 0.82]
    assert all(abs(y - rows["endpoint 0 (2 failovers)"]) < 0.5 for _, y in failovers)
    assert markers(figure, "fault 0") == [(0.8, rows["endpoint 0 (2 failovers)"]), (0.8, rows["r2"])]
    assert by_gid(figure, "endpoint 1 down") == []


def test_a_scenario_without_endpoints_or_baseline_draws_neither() -> None:
    figure, axes = drawn(scenario())
    gids = {artist.get_gid() or "" for artist in figure.findobj()}

    assert not any(gid.startswith(("endpoint", "baseline")) for gid in gids)
    assert not any(label.startswith("endpoint") for label in row_y(axes))
    assert axes.get_xlabel() == "seconds since the faulted run started"


def test_the_baseline_rollout_is_a_thin_bar_under_the_faulted_one_in_the_same_row() -> None:
    baseline = [rollout(index, 0.05 * index, generate_s=0.6) for index in range(4)]
    figure, axes = drawn(scenario(baseline_rollouts=baseline))
    rows = row_y(axes)

    for index, expected in enumerate(baseline):
        bar = one_bar(figure, f"baseline r{index}")
        call = one_bar(figure, f"r{index} generate turn 0 attempt 0")
        start, end = expected.spans[0].start_s, expected.spans[-1].end_s
        assert (bar.get_x(), bar.get_x() + bar.get_width()) == pytest.approx((start, end))
        assert bar.get_height() < call.get_height() / 3
        # Under the calls (y grows downwards) and inside the row.
        assert call.get_y() + call.get_height() <= bar.get_y()
        assert rows[f"r{index}"] - 0.5 < bar.get_y() + bar.get_height() <= rows[f"r{index}"] + 0.5
    (end_line,) = by_gid(figure, "baseline end")
    assert end_line.get_xdata()[0] == pytest.approx(baseline[-1].spans[-1].end_s)  # type: ignore[attr-defined]
    assert axes.get_xlabel() == "seconds since each run started"


def test_a_scenario_with_everything_renders_a_png(tmp_path: Path) -> None:
    import matplotlib.image

    result = scenario(
        endpoints=[EndpointSpan(0, down_s=[(1.0, 1.0000001)], failovers_s=[1.0]), EndpointSpan(1)],
        baseline_rollouts=[rollout(index, 0.0) for index in range(4)],
    )
    pixels = matplotlib.image.imread(plot_timeline(result, tmp_path / "all.png"))

    assert pixels.shape[1] == 1200
    assert pixels.std() > 0.05
