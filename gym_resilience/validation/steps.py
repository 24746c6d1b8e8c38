"""The validator's checks of a step-wise batch: one row per step, each trajectory's steps contiguous."""

from __future__ import annotations

from typing import Any

from gym_resilience.trajectories import BatchOutput, TrajectoryId
from gym_resilience.validation.columns import column, is_well_formed
from gym_resilience.validation.placeholders import placeholder_rows
from gym_resilience.validation.values import show

__all__ = [
    "check_is_last_step_matches_trajectory_ids",
    "check_is_last_step_present",
    "check_is_last_step_types",
    "check_last_row_ends_trajectory",
    "check_placeholders_are_one_step",
    "check_step_trajectory_ids_present",
    "check_steps_contiguous",
]


def check_is_last_step_present(output: BatchOutput) -> list[str]:
    """A step-wise batch has an ``is_last_step`` column."""
    if getattr(output, "is_last_step", None) is None:
        return ["batch: is_last_step is None; a step-wise batch needs it"]
    return []


def check_is_last_step_types(output: BatchOutput) -> list[str]:
    """``is_last_step`` holds real bools, not ints."""
    return [
        f"sample {index}: is_last_step is {show(flag)}, expected a bool"
        for index, flag in enumerate(column(output, "is_last_step"))
        if not isinstance(flag, bool)
    ]


def check_last_row_ends_trajectory(output: BatchOutput) -> list[str]:
    """The last row of a step-wise batch ends its trajectory."""
    flags = column(output, "is_last_step")
    if flags and flags[-1] is False:
        return [f"sample {len(flags) - 1}: is_last_step is False but the last row must end its trajectory"]
    return []


def check_step_trajectory_ids_present(output: BatchOutput) -> list[str]:
    """Every row of a step-wise batch has a trajectory id: rows are grouped by it."""
    return [
        f"sample {index}: trajectory_ids is None; a step-wise batch needs a trajectory id on every row"
        for index, tid in enumerate(column(output, "trajectory_ids"))
        if tid is None
    ]


def check_steps_contiguous(output: BatchOutput) -> list[str]:
    """The steps of one trajectory are contiguous: an id never reappears after a different one."""
    problems = []
    first_row: dict[TrajectoryId, int] = {}
    previous: Any = None
    for index, tid in enumerate(column(output, "trajectory_ids")):
        if isinstance(tid, TrajectoryId) and is_well_formed(tid) and tid != previous:  # else reported
            if tid in first_row:
                problems.append(
                    f"sample {index}: trajectory_ids {tid} reappears after another trajectory "
                    f"(its steps began at sample {first_row[tid]}); a trajectory's steps must be contiguous"
                )
            else:
                first_row[tid] = index
        previous = tid
    return problems


def check_is_last_step_matches_trajectory_ids(output: BatchOutput) -> list[str]:
    """``is_last_step`` is True exactly where the next row has another trajectory id."""
    flags = column(output, "is_last_step")
    ids = column(output, "trajectory_ids")
    problems = []
    for index in range(min(len(flags), len(ids)) - 1):
        flag, current, following = flags[index], ids[index], ids[index + 1]
        if not (isinstance(current, TrajectoryId) and isinstance(following, TrajectoryId)):
            continue
        if flag is True and current == following:
            problems.append(
                f"sample {index}: is_last_step is True but sample {index + 1} continues trajectory {current}"
            )
        elif flag is False and current != following:
            problems.append(
                f"sample {index}: is_last_step is False but sample {index + 1} starts another trajectory "
                f"({following}, not {current})"
            )
    return problems


def check_placeholders_are_one_step(output: BatchOutput) -> list[str]:
    """In a step-wise batch a placeholder is a whole trajectory of one step."""
    flags = column(output, "is_last_step")
    ids = column(output, "trajectory_ids")
    problems = []
    for index in placeholder_rows(output):
        if index < len(flags) and flags[index] is False:
            problems.append(
                f"sample {index}: is_last_step of a placeholder is False, expected True; "
                "a placeholder is a one-step trajectory"
            )
        if 0 < index < len(ids) and isinstance(ids[index], TrajectoryId) and ids[index] == ids[index - 1]:
            problems.append(
                f"sample {index}: trajectory_ids of a placeholder continues trajectory {ids[index]} "
                f"from sample {index - 1}; a placeholder is a one-step trajectory"
            )
    return problems
