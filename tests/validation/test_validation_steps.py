"""The checks of a step-wise batch: one row per step, each trajectory's steps contiguous and ended.

Messages are the contract (``sample <i>: <column> ...`` or ``batch: <column> ...``), so they are matched
exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from small_batches import A, B, passes, placeholder, problems, real, step_wise_batch

from gym_resilience.trajectories import (
    BatchOutput,
    StepWiseTrajectory,
    TrajectoryId,
    build_batch_output,
)
from gym_resilience.validation import validate_batch_output

# A valid batch must not warn either, unless a test says so.
pytestmark = pytest.mark.filterwarnings("error::gym_resilience.validation.OutputValidationWarning")


# Step-wise checks.


def test_step_wise_batch_without_is_last_step_is_reported() -> None:
    output = step_wise_batch()
    output.is_last_step = None
    assert problems(output, step_wise=True) == ["batch: is_last_step is None; a step-wise batch needs it"]


def test_is_last_step_is_not_required_outside_step_wise_mode() -> None:
    output = step_wise_batch()
    output.is_last_step = None
    passes(output, step_wise=False)


@pytest.mark.parametrize(("bad", "shown"), [(1, "1 (int)"), (0, "0 (int)"), (None, "None (NoneType)")])
def test_is_last_step_that_is_not_a_bool_is_reported(bad: Any, shown: str) -> None:
    output = step_wise_batch()
    assert output.is_last_step is not None
    output.is_last_step[1] = bad
    assert problems(output, step_wise=True) == [f"sample 1: is_last_step is {shown}, expected a bool"]


def test_step_wise_batch_whose_last_row_is_not_last_step_is_reported() -> None:
    output = step_wise_batch()
    assert output.is_last_step is not None
    output.is_last_step[4] = False
    assert problems(output, step_wise=True) == [
        "sample 4: is_last_step is False but the last row must end its trajectory"
    ]


def test_step_wise_row_without_trajectory_id_is_reported() -> None:
    output = step_wise_batch()
    output.trajectory_ids[2] = None
    assert problems(output, step_wise=True) == [
        "sample 2: trajectory_ids is None; a step-wise batch needs a trajectory id on every row"
    ]


def test_trajectory_reappearing_after_another_is_reported() -> None:
    output = step_wise_batch()
    assert output.is_last_step is not None
    # a, a, b, a, c: is_last_step stays consistent with the id changes, only contiguity is broken.
    output.trajectory_ids[3] = A
    output.is_last_step[3] = True
    assert problems(output, step_wise=True) == [
        "sample 3: trajectory_ids a_0 reappears after another trajectory (its steps began at sample 0); "
        "a trajectory's steps must be contiguous"
    ]


def test_is_last_step_true_inside_a_trajectory_is_reported() -> None:
    output = step_wise_batch()
    assert output.is_last_step is not None
    output.is_last_step[0] = True
    assert problems(output, step_wise=True) == [
        "sample 0: is_last_step is True but sample 1 continues trajectory a_0"
    ]


def test_is_last_step_false_where_the_trajectory_changes_is_reported() -> None:
    output = step_wise_batch()
    assert output.is_last_step is not None
    output.is_last_step[2] = False
    assert problems(output, step_wise=True) == [
        "sample 2: is_last_step is False but sample 3 starts another trajectory (c_0, not b_0)"
    ]


def test_step_wise_checks_do_not_run_outside_step_wise_mode() -> None:
    output = step_wise_batch()
    assert output.is_last_step is not None
    output.is_last_step[2] = False
    output.trajectory_ids[4] = None
    passes(output, step_wise=False)


def step_wise_with_placeholder() -> BatchOutput:
    """a (2 steps), then placeholder p (1 step), then b (1 step)."""
    p = TrajectoryId("p", 0)
    return build_batch_output(
        [
            StepWiseTrajectory(steps=[real([10], tid=A), real([11], tid=A)], trajectory_id=A, e2e_time=1.0),
            StepWiseTrajectory(
                steps=[placeholder(tid=p)], trajectory_id=p, e2e_time=0.5, is_placeholder=True
            ),
            StepWiseTrajectory(steps=[real([12], tid=B)], trajectory_id=B, e2e_time=1.0),
        ]
    )


def test_step_wise_placeholder_that_is_not_last_step_is_reported() -> None:
    output = step_wise_with_placeholder()
    assert output.is_last_step is not None
    output.trajectory_ids[3] = output.trajectory_ids[2]
    output.is_last_step[2] = False
    assert problems(output, step_wise=True) == [
        "sample 2: is_last_step of a placeholder is False, expected True; "
        "a placeholder is a one-step trajectory"
    ]


def test_step_wise_placeholder_continuing_a_trajectory_is_reported() -> None:
    output = step_wise_with_placeholder()
    assert output.is_last_step is not None
    output.trajectory_ids[2] = A
    output.is_last_step[1] = False
    assert problems(output, step_wise=True) == [
        "sample 2: trajectory_ids of a placeholder continues trajectory a_0 from sample 1; "
        "a placeholder is a one-step trajectory"
    ]


@pytest.mark.parametrize(
    ("tid", "shown"),
    [
        (TrajectoryId(["a"], 0), "instance_id ['a'] and repetition 0 (int)"),  # type: ignore[arg-type]
        (TrajectoryId("a", 0.5), "instance_id 'a' (str) and repetition 0.5 (float)"),  # type: ignore[arg-type]
        (TrajectoryId("a", True), "instance_id 'a' (str) and repetition True (bool)"),
    ],
)
def test_a_trajectory_id_with_fields_of_the_wrong_type_is_reported_never_raised(
    tid: TrajectoryId, shown: str
) -> None:
    output = step_wise_batch()
    output.trajectory_ids[3] = output.trajectory_ids[4] = tid  # trajectory c's two steps
    expected = [f"sample {row}: trajectory_ids has {shown}, expected a str and an int" for row in (3, 4)]
    assert problems(output, step_wise=True) == expected


def test_skyrls_trajectory_ids_with_numpys_integers_are_read_as_trajectory_ids() -> None:
    @dataclass
    class SkyRLTrajectoryID:
        instance_id: str
        repetition_id: Any

    data = step_wise_batch().to_dict()
    data["trajectory_ids"] = [
        SkyRLTrajectoryID(t.instance_id, np.int64(t.repetition)) for t in data["trajectory_ids"]
    ]
    validate_batch_output(data, num_prompts=3, step_wise=True)
