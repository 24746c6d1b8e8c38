"""Property tests: random valid batches pass; one corrupted field is always reported, naming its row.

Messages are the contract (``sample <i>: <column> ...`` or ``batch: <column> ...``), so they are matched
exactly.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from small_batches import placeholder

from gym_resilience.errors import OutputValidationError
from gym_resilience.trajectories import (
    ROLLOUT_ERROR_STOP_REASON,
    BatchOutput,
    StepWiseTrajectory,
    Trajectory,
    TrajectoryId,
    build_batch_output,
)
from gym_resilience.validation import (
    OutputValidationWarning,
    validate_batch_output,
)

# A valid batch must not warn either, unless a test says so.
pytestmark = pytest.mark.filterwarnings("error::gym_resilience.validation.OutputValidationWarning")


@dataclass
class Shape:
    token_level: bool
    logprobs: bool
    step_wise: bool


@st.composite
def trajectories(draw: st.DrawFn, shape: Shape, tid: TrajectoryId) -> Trajectory:
    """A valid real (non-placeholder) trajectory."""
    length = draw(st.integers(1, 6))
    finite = st.floats(-10, 10, allow_nan=False) | st.integers(-3, 3)
    return Trajectory(
        prompt_ids=draw(st.lists(st.integers(0, 2**31), min_size=1, max_size=6)),
        response_ids=draw(st.lists(st.integers(0, 2**31), min_size=length, max_size=length)),
        reward=draw(st.lists(finite, min_size=length, max_size=length))
        if shape.token_level
        else draw(finite),
        loss_mask=draw(st.lists(st.sampled_from([0, 1]), min_size=length, max_size=length)),
        stop_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        rollout_logprobs=(
            draw(st.lists(st.floats(-30, 0), min_size=length, max_size=length)) if shape.logprobs else None
        ),
        trajectory_id=tid,
        e2e_time=draw(st.none() | st.floats(0, 100)),
    )


@st.composite
def valid_batches(draw: st.DrawFn) -> tuple[list[Trajectory | StepWiseTrajectory], Shape]:
    shape = Shape(
        token_level=draw(st.booleans()), logprobs=draw(st.booleans()), step_wise=draw(st.booleans())
    )
    count = draw(st.integers(1, 6))
    is_placeholder = draw(st.lists(st.booleans(), min_size=count, max_size=count))
    result: list[Trajectory | StepWiseTrajectory] = []
    for index, failed in enumerate(is_placeholder):
        tid = TrajectoryId(f"task{index // 2}", index % 2)
        if failed:
            steps = [placeholder(token_level=shape.token_level, logprobs=shape.logprobs, tid=tid)]
        else:
            steps = [
                draw(trajectories(shape, tid))
                for _ in range(draw(st.integers(1, 3) if shape.step_wise else st.just(1)))
            ]
        if shape.step_wise:
            result.append(
                StepWiseTrajectory(
                    steps=steps, trajectory_id=tid, e2e_time=steps[0].e2e_time, is_placeholder=failed
                )
            )
            if draw(st.booleans()):
                result.append(StepWiseTrajectory(steps=[]))  # a rollout without steps adds no row
        else:
            result.extend(steps)
    return result, shape


def _validate_expecting_warning_iff_all_masks_zero(
    output: BatchOutput, num_prompts: int, step_wise: bool
) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate_batch_output(output, num_prompts, step_wise=step_wise)
    warned = [w for w in caught if issubclass(w.category, OutputValidationWarning)]
    all_zero = not any(value for mask in output.loss_masks for value in mask)
    assert len(warned) == (1 if all_zero else 0)


@settings(max_examples=200, deadline=None)
@given(valid_batches())
def test_random_valid_batches_pass(drawn: tuple[list[Trajectory | StepWiseTrajectory], Shape]) -> None:
    items, shape = drawn
    output = build_batch_output(items)
    assert (output.is_last_step is not None) == shape.step_wise
    assert (output.rollout_logprobs is not None) == shape.logprobs
    _validate_expecting_warning_iff_all_masks_zero(output, len(items), shape.step_wise)


@settings(max_examples=100, deadline=None)
@given(valid_batches())
def test_random_valid_batches_pass_as_generator_output_dicts_and_come_back_unchanged(
    drawn: tuple[list[Trajectory | StepWiseTrajectory], Shape],
) -> None:
    items, shape = drawn
    output = build_batch_output(items)
    data = output.to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OutputValidationWarning)  # all-zero masks: the test above checks it
        validate_batch_output(data, len(items), step_wise=shape.step_wise)
    assert BatchOutput.from_dict(data) == output


Corruption = Callable[[BatchOutput, int, st.DataObject], bool]
"""Breaks one field of one row in place; returns False when it does not apply to that row."""


def draw_any(data: st.DataObject, values: list[Any]) -> Any:
    """One of ``values``, typed Any: corruptions put values of the wrong type on purpose."""
    return data.draw(st.sampled_from(values))


def _pick(data: st.DataObject, row: list[Any]) -> int:
    return data.draw(st.integers(0, len(row) - 1))


def empty_response(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    output.response_ids[i] = []
    return True


def extra_response_token(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    output.response_ids[i].append(data.draw(st.integers(0, 100)))
    return True


def bad_token_id(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    column = draw_any(data, [output.response_ids, output.prompt_token_ids])
    column[i][_pick(data, column[i])] = draw_any(data, [True, False, -1, 1.0, "7", None])
    return True


def empty_prompt(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    output.prompt_token_ids[i] = []
    return True


def bad_mask_value(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    mask = output.loss_masks[i]
    mask[_pick(data, mask)] = draw_any(data, [2, -1, True, False, 1.0, 0.0, None])
    return True


def extra_mask_entry(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    output.loss_masks[i].append(draw_any(data, [0, 1]))
    return True


def bad_reward_value(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    bad = draw_any(data, [math.nan, math.inf, -math.inf, True, False, "1", None])
    reward = output.rewards[i]
    if isinstance(reward, list):
        reward[_pick(data, reward)] = bad
    else:
        output.rewards[i] = bad
    return True


def switched_reward_kind(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    if len(output) < 2:
        return False  # one row is uniform whatever its kind
    reward = output.rewards[i]
    output.rewards[i] = reward[0] if isinstance(reward, list) else [reward] * len(output.response_ids[i])
    return True


def token_reward_of_wrong_length(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    reward = output.rewards[i]
    if not isinstance(reward, list):
        return False
    if data.draw(st.booleans()):
        reward.append(0.0)
    else:
        reward.pop()
    return True


def bad_logprob(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    if output.rollout_logprobs is None:
        return False
    row = output.rollout_logprobs[i]
    row[_pick(data, row)] = draw_any(data, [0.5, 1e-9, math.nan, -math.inf, math.inf, True, "x", None])
    return True


def logprobs_of_wrong_length(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    if output.rollout_logprobs is None:
        return False
    row = output.rollout_logprobs[i]
    if data.draw(st.booleans()):
        row.append(-0.5)
    else:
        row.pop()
    return True


def bad_stop_reason(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    if output.is_placeholder[i]:
        bad = draw_any(data, ["stop", "length", "abort", None, 1])
    else:
        bad = draw_any(data, [ROLLOUT_ERROR_STOP_REASON, None, 1, b"stop"])
    output.stop_reasons[i] = bad
    return True


def bad_placeholder_flag(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    flag = output.is_placeholder[i]
    output.is_placeholder[i] = draw_any(data, [not flag, int(flag), None])
    return True


def bad_trajectory_id(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    choices: list[Any] = ["task0_0", 7, ("task0", 0)]
    if output.is_last_step is not None:
        choices.append(None)
    output.trajectory_ids[i] = data.draw(st.sampled_from(choices))
    return True


def reassigned_trajectory_id(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    if output.is_last_step is None:
        return False  # outside step-wise mode ids are labels only
    others = sorted({tid for tid in output.trajectory_ids if tid != output.trajectory_ids[i]}, key=str)
    if not others:
        return False
    output.trajectory_ids[i] = data.draw(st.sampled_from(others))
    return True


def bad_last_step_flag(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    if output.is_last_step is None:
        return False
    flag = output.is_last_step[i]
    output.is_last_step[i] = draw_any(data, [not flag, int(flag), None])
    return True


def bad_generation_time(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    if output.trajectory_generation_times is None:
        return False
    output.trajectory_generation_times[i] = draw_any(data, [-0.1, math.nan, math.inf, "1.0", None])
    return True


def bad_env_metrics_row(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    if output.env_metrics is None:
        return False
    output.env_metrics[i] = draw_any(data, [None, [], "steps", 1.0])
    return True


def placeholder_with_real_values(output: BatchOutput, i: int, data: st.DataObject) -> bool:
    if not output.is_placeholder[i]:
        return False
    reward = output.rewards[i]
    which = draw_any(data, ["reward", "mask", "logprob"])
    if which == "reward":
        output.rewards[i] = [1.0] if isinstance(reward, list) else 1.0
    elif which == "mask":
        output.loss_masks[i] = [1]
    elif output.rollout_logprobs is not None:
        output.rollout_logprobs[i] = [-0.25]
    else:
        return False
    return True


CORRUPTIONS: list[Corruption] = [
    empty_response,
    extra_response_token,
    bad_token_id,
    empty_prompt,
    bad_mask_value,
    extra_mask_entry,
    bad_reward_value,
    switched_reward_kind,
    token_reward_of_wrong_length,
    bad_logprob,
    logprobs_of_wrong_length,
    bad_stop_reason,
    bad_placeholder_flag,
    bad_trajectory_id,
    reassigned_trajectory_id,
    bad_last_step_flag,
    bad_generation_time,
    bad_env_metrics_row,
    placeholder_with_real_values,
]


# Many examples: each of the 19 corruption kinds needs its share, in both modes. No deadline: the machine is
# shared and a slow example is not a failure.
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(valid_batches(), st.sampled_from(CORRUPTIONS), st.data())
def test_random_single_field_corruption_is_reported_naming_its_row(
    drawn: tuple[list[Trajectory | StepWiseTrajectory], Shape], corrupt: Corruption, data: st.DataObject
) -> None:
    items, shape = drawn
    output = build_batch_output(items)
    row = data.draw(st.integers(0, len(output) - 1), label="row")
    assume(corrupt(output, row, data))
    with pytest.raises(OutputValidationError) as info:
        validate_batch_output(output, len(items), step_wise=shape.step_wise)
    naming_row = re.compile(rf"\bsample {row}\b")
    assert any(naming_row.search(problem) for problem in info.value.problems), info.value.problems
