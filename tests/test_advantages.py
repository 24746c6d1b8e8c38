"""Group-relative advantages: placeholders must not bias GRPO.

The hand-worked batch used throughout::

    prompt "a": rewards 1.0, 0.0, 1.0 and one placeholder (0.0)
    prompt "b": rewards 0.5, 0.5

Excluding the placeholder, group a is {1, 0, 1}:
    mean = 2/3
    sample std = sqrt(((1/3)^2 + (2/3)^2 + (1/3)^2) / (3 - 1)) = sqrt(1/3) = 0.5773502691896257
    advantages = (1/3) / (sqrt(1/3) + 1e-6) =  0.5773492691913578  for the two 1.0s
                 (-2/3) / (sqrt(1/3) + 1e-6) = -1.1546985383827155  for the 0.0
Including it, group a is {1, 0, 1, 0}: the placeholder's 0.0 pulls the mean down to 1/2, and
    sample std = sqrt(4 * (1/2)^2 / (4 - 1)) = sqrt(1/3) (the same std here, by coincidence)
    advantages = (1/2) / (sqrt(1/3) + 1e-6) =  0.8660239037870368  for the two 1.0s (inflated)
                 (-1/2) / (sqrt(1/3) + 1e-6) = -0.8660239037870368  for the 0.0 (less penalised)
Group b has equal rewards: std 0, every advantage 0.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gym_resilience.advantages import GroupAdvantages, GroupStats, group_relative_advantages
from gym_resilience.errors import OutputValidationError, UnsupportedConfigError
from gym_resilience.trajectories import (
    ROLLOUT_ERROR_STOP_REASON,
    AnyTrajectory,
    BatchOutput,
    StepWiseTrajectory,
    Trajectory,
    TrajectoryId,
    build_batch_output,
)
from gym_resilience.validation import validate_batch_output

EPS = 1e-6
ROOT_THIRD = math.sqrt(1 / 3)  # 0.5773502691896257

# Group a, placeholder excluded: mean 2/3, std sqrt(1/3).
A_ONE_EXCLUDED = (1.0 - 2 / 3) / (ROOT_THIRD + EPS)  # 0.5773492691913578
A_ZERO_EXCLUDED = (0.0 - 2 / 3) / (ROOT_THIRD + EPS)  # -1.1546985383827155
# Group a, placeholder included: mean 1/2, std sqrt(1/3).
A_ONE_INCLUDED = (1.0 - 1 / 2) / (ROOT_THIRD + EPS)  # 0.8660239037870368
A_ZERO_INCLUDED = (0.0 - 1 / 2) / (ROOT_THIRD + EPS)  # -0.8660239037870368


def exactly(value: float) -> object:
    """Hand-worked numbers agree to float rounding, not to a loose tolerance."""
    return pytest.approx(value, rel=1e-12, abs=1e-15)


# Builders.


def real(
    instance: str,
    repetition: int,
    reward: float | list[float],
    *,
    length: int = 2,
    mask: list[int] | None = None,
) -> Trajectory:
    return Trajectory(
        prompt_ids=[1, 2],
        response_ids=[10 + i for i in range(length)],
        reward=reward,
        loss_mask=mask if mask is not None else [1] * length,
        stop_reason="stop",
        trajectory_id=TrajectoryId(instance, repetition),
    )


def placeholder(instance: str, repetition: int, *, token_level: bool = False) -> Trajectory:
    """A placeholder as the runner builds it."""
    return Trajectory(
        prompt_ids=[0],
        response_ids=[0],
        reward=[0.0] if token_level else 0.0,
        loss_mask=[0],
        stop_reason=ROLLOUT_ERROR_STOP_REASON,
        trajectory_id=TrajectoryId(instance, repetition),
        is_placeholder=True,
    )


def hand_worked_batch(*, with_placeholder: bool = True) -> BatchOutput:
    """Rows: a0=1.0, a1=0.0, a2=placeholder, a3=1.0, b0=0.5, b1=0.5 (a2 left out when asked)."""
    rows = [
        real("a", 0, 1.0, length=3, mask=[1, 0, 1]),
        real("a", 1, 0.0),
        *([placeholder("a", 2)] if with_placeholder else []),
        real("a", 3, 1.0),
        real("b", 0, 0.5),
        real("b", 1, 0.5),
    ]
    batch = build_batch_output(rows)
    validate_batch_output(batch, num_prompts=len(rows))
    return batch


# The hand-worked batch.


def test_excluding_placeholders_gives_the_hand_worked_advantages() -> None:
    result = group_relative_advantages(hand_worked_batch())

    assert result.advantages == [
        exactly(A_ONE_EXCLUDED),
        exactly(A_ZERO_EXCLUDED),
        0.0,  # the placeholder
        exactly(A_ONE_EXCLUDED),
        0.0,
        0.0,
    ]
    assert result.groups["a"].mean == exactly(2 / 3)
    assert result.groups["a"].std == exactly(ROOT_THIRD)
    assert result.groups["b"].mean == 0.5
    assert result.groups["b"].std == 0.0


def test_including_placeholders_shows_the_bias_the_placeholder_causes() -> None:
    result = group_relative_advantages(hand_worked_batch(), exclude_placeholders=False)

    assert result.advantages == [
        exactly(A_ONE_INCLUDED),
        exactly(A_ZERO_INCLUDED),
        0.0,  # a placeholder's own advantage is 0 either way: it carries no loss
        exactly(A_ONE_INCLUDED),
        0.0,
        0.0,
    ]
    assert result.groups["a"].mean == 0.5
    assert result.groups["a"].std == exactly(ROOT_THIRD)
    # The bias: the successes look better than they are (0.866, not 0.577), the failure less bad
    # (-0.866, not -1.155), though the placeholder itself is never trained on.
    assert result.advantages[0] - A_ONE_EXCLUDED == exactly(0.2886746345956790)
    assert result.advantages[1] - A_ZERO_EXCLUDED == exactly(0.2886746345956787)


def test_excluded_placeholders_leave_the_advantages_of_the_same_batch_without_them() -> None:
    with_placeholder = group_relative_advantages(hand_worked_batch())
    without = group_relative_advantages(hand_worked_batch(with_placeholder=False))

    real_rows = [0, 1, 3, 4, 5]
    assert [with_placeholder.advantages[i] for i in real_rows] == without.advantages
    included = group_relative_advantages(hand_worked_batch(), exclude_placeholders=False)
    assert [included.advantages[i] for i in real_rows] != without.advantages


def test_without_std_normalisation_only_the_group_mean_is_subtracted() -> None:
    excluded = group_relative_advantages(hand_worked_batch(), normalize_std=False)
    included = group_relative_advantages(hand_worked_batch(), normalize_std=False, exclude_placeholders=False)

    # Excluded: mean 2/3. Included: mean 1/2.
    assert excluded.advantages == [exactly(1 / 3), exactly(-2 / 3), 0.0, exactly(1 / 3), 0.0, 0.0]
    assert included.advantages == [0.5, -0.5, 0.0, 0.5, 0.0, 0.0]
    assert excluded.groups["a"].std is None


def test_epsilon_is_added_to_the_std_before_dividing() -> None:
    result = group_relative_advantages(hand_worked_batch(), epsilon=0.5)

    assert result.advantages[0] == exactly((1 / 3) / (ROOT_THIRD + 0.5))
    assert result.advantages[1] == exactly((-2 / 3) / (ROOT_THIRD + 0.5))


# Failed-group policies.


def test_mask_group_zeroes_exactly_the_loss_masks_and_advantages_of_the_failed_group() -> None:
    batch = hand_worked_batch()

    result = group_relative_advantages(batch, failed_group_policy="mask_group")

    assert result.loss_masks == [[0, 0, 0], [0, 0], [0], [0, 0], [1, 1], [1, 1]]
    assert result.advantages == [0.0] * 6
    assert result.token_advantages == [[0.0] * 3, [0.0] * 2, [0.0], [0.0] * 2, [0.0] * 2, [0.0] * 2]
    assert result.failed_groups == ("a",)
    assert result.masked_groups == ("a",)
    assert result.groups["a"].masked
    assert not result.groups["b"].masked


def test_mask_group_leaves_groups_without_placeholders_as_keep_does() -> None:
    batch = build_batch_output([real("a", 0, 1.0), real("a", 1, 0.0), real("b", 0, 1.0), placeholder("b", 1)])

    masked = group_relative_advantages(batch, failed_group_policy="mask_group")
    kept = group_relative_advantages(batch, failed_group_policy="keep")

    # Group a: {1, 0}, mean 1/2, std sqrt(1/2) = 0.7071067811865476.
    assert (
        masked.advantages[:2]
        == kept.advantages[:2]
        == [
            exactly(0.5 / (math.sqrt(0.5) + EPS)),  # 0.7071057811879616
            exactly(-0.5 / (math.sqrt(0.5) + EPS)),
        ]
    )
    assert masked.loss_masks == [[1, 1], [1, 1], [0, 0], [0]]
    assert masked.masked_groups == ("b",)


def test_keep_leaves_the_loss_masks_as_they_were() -> None:
    batch = hand_worked_batch()

    result = group_relative_advantages(batch, failed_group_policy="keep")

    assert result.loss_masks == [[1, 0, 1], [1, 1], [0], [1, 1], [1, 1], [1, 1]]
    assert result.loss_masks == batch.loss_masks
    assert result.failed_groups == ("a",)
    assert result.masked_groups == ()


# Shapes of rewards and groups.


def test_token_level_rewards_are_summed_per_row_and_advantages_broadcast_over_each_response() -> None:
    batch = build_batch_output(
        [
            real("a", 0, [0.25, 0.75, 0.0], length=3),  # sums to 1.0
            real("a", 1, [0.0, 0.0]),  # 0.0
            placeholder("a", 2, token_level=True),
            real("a", 3, [1.0], length=1),  # 1.0
            real("b", 0, [0.5, 0.0], length=2),
            real("b", 1, [0.25, 0.25], length=2),
        ]
    )

    result = group_relative_advantages(batch)

    # The same scalar rewards as the hand-worked batch: a {1, 0, 1} excluding the placeholder, b {0.5, 0.5}.
    assert result.advantages == [
        exactly(A_ONE_EXCLUDED),
        exactly(A_ZERO_EXCLUDED),
        0.0,
        exactly(A_ONE_EXCLUDED),
        0.0,
        0.0,
    ]
    assert result.token_advantages == [
        [result.advantages[0]] * 3,
        [result.advantages[1]] * 2,
        [0.0],
        [result.advantages[3]],
        [0.0, 0.0],
        [0.0, 0.0],
    ]


def test_groups_are_formed_by_instance_id_wherever_their_rows_are() -> None:
    interleaved = build_batch_output(
        [
            real("b", 0, 0.5),
            real("a", 0, 1.0),
            placeholder("a", 2),
            real("b", 1, 0.5),
            real("a", 1, 0.0),
            real("a", 3, 1.0),
        ]
    )

    result = group_relative_advantages(interleaved)

    assert result.advantages == [
        0.0,
        exactly(A_ONE_EXCLUDED),
        0.0,
        0.0,
        exactly(A_ZERO_EXCLUDED),
        exactly(A_ONE_EXCLUDED),
    ]
    assert list(result.groups) == ["b", "a"]
    assert result.groups["a"].rows == (1, 2, 4, 5)


def test_a_group_left_with_one_real_row_has_no_relative_signal_and_gets_zero() -> None:
    batch = build_batch_output([real("a", 0, 1.0), placeholder("a", 1), real("b", 0, 0.7)])

    excluded = group_relative_advantages(batch)
    included = group_relative_advantages(batch, exclude_placeholders=False)

    assert excluded.advantages == [0.0, 0.0, 0.0]
    assert excluded.groups["a"] == GroupStats(
        instance_id="a", rows=(0, 1), num_samples=2, num_placeholders=1, mean=1.0, std=None, masked=False
    )
    assert excluded.groups["b"].mean == 0.7
    assert excluded.groups["b"].std is None
    # Included, the placeholder makes a "group" of {1, 0}: mean 1/2, std sqrt(1/2), advantage 0.707.
    assert included.advantages[0] == exactly(0.5 / (math.sqrt(0.5) + EPS))


def test_a_group_of_only_placeholders_gets_zero_and_leaves_other_groups_alone() -> None:
    batch = build_batch_output(
        [placeholder("a", 0), placeholder("a", 1), real("b", 0, 1.0), real("b", 1, 0.0)]
    )

    for exclude in (True, False):
        result = group_relative_advantages(batch, exclude_placeholders=exclude)
        assert result.advantages[:2] == [0.0, 0.0]
        assert result.advantages[2:] == [
            exactly(0.5 / (math.sqrt(0.5) + EPS)),
            exactly(-0.5 / (math.sqrt(0.5) + EPS)),
        ]
    excluded = group_relative_advantages(batch)
    assert excluded.groups["a"].mean is None
    assert excluded.groups["a"].std is None
    assert excluded.groups["a"].num_placeholders == 2


def test_equal_rewards_get_zero_advantage_even_with_zero_epsilon() -> None:
    # 0.1 has no exact binary form: the exact mean still equals each reward, so nothing is divided by 0.
    batch = build_batch_output([real("a", i, 0.1) for i in range(3)])

    result = group_relative_advantages(batch, epsilon=0.0)

    assert result.advantages == [0.0, 0.0, 0.0]
    assert result.groups["a"].std == 0.0


def test_an_empty_batch_gives_empty_advantages() -> None:
    result = group_relative_advantages(build_batch_output([]))

    assert result == GroupAdvantages(
        advantages=[], token_advantages=[], loss_masks=[], groups={}, failed_groups=(), masked_groups=()
    )


def test_integer_rewards_are_read_as_floats() -> None:
    batch = build_batch_output([real("a", 0, 1), real("a", 1, 0)])

    result = group_relative_advantages(batch, normalize_std=False)

    assert result.advantages == [0.5, -0.5]
    assert all(type(value) is float for value in result.advantages)


# Step-wise batches.


def step_wise_batch() -> BatchOutput:
    """a0: 2 steps, outcome 1.0; a1: 1 step, outcome 0.0; a2: placeholder; b0, b1: outcomes 1.0 and 0.0."""

    def trajectory(instance: str, repetition: int, rewards: list[float]) -> StepWiseTrajectory:
        tid = TrajectoryId(instance, repetition)
        return StepWiseTrajectory(
            steps=[real(instance, repetition, reward) for reward in rewards], trajectory_id=tid
        )

    def failed(instance: str, repetition: int) -> StepWiseTrajectory:
        tid = TrajectoryId(instance, repetition)
        return StepWiseTrajectory(
            steps=[placeholder(instance, repetition)], trajectory_id=tid, is_placeholder=True
        )

    trajectories: list[AnyTrajectory] = [
        trajectory("a", 0, [0.25, 1.0]),  # the first step's 0.25 is not the outcome and does not count
        trajectory("a", 1, [0.0]),
        failed("a", 2),
        trajectory("b", 0, [0.0, 0.0, 1.0]),
        trajectory("b", 1, [0.0]),
    ]
    batch = build_batch_output(trajectories)
    validate_batch_output(batch, num_prompts=len(trajectories), step_wise=True)
    return batch


def test_step_wise_advantages_use_each_trajectorys_last_step_and_cover_all_its_steps() -> None:
    batch = step_wise_batch()
    assert batch.is_last_step == [False, True, True, True, False, False, True, True]

    result = group_relative_advantages(batch)

    # Both groups have outcomes {1, 0}: mean 1/2, std sqrt(1/2), advantages +-0.7071057811879616.
    plus, minus = 0.5 / (math.sqrt(0.5) + EPS), -0.5 / (math.sqrt(0.5) + EPS)
    assert result.advantages == [
        exactly(plus),
        exactly(plus),
        exactly(minus),
        0.0,
        exactly(plus),
        exactly(plus),
        exactly(plus),
        exactly(minus),
    ]
    assert result.groups["a"] == GroupStats(
        instance_id="a",
        rows=(0, 1, 2, 3),
        num_samples=3,
        num_placeholders=1,
        mean=0.5,
        std=math.sqrt(0.5),
        masked=False,
    )
    assert result.groups["b"].num_samples == 2


def test_step_wise_placeholder_biases_its_group_unless_excluded() -> None:
    result = group_relative_advantages(step_wise_batch(), exclude_placeholders=False)

    # Group a outcomes {1, 0, 0}: mean 1/3, std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3).
    assert result.advantages[:4] == [
        exactly((2 / 3) / (ROOT_THIRD + EPS)),  # 1.1546985383827155, not 0.7071
        exactly((2 / 3) / (ROOT_THIRD + EPS)),
        exactly((-1 / 3) / (ROOT_THIRD + EPS)),  # -0.5773492691913578, not -0.7071
        0.0,
    ]


def test_step_wise_mask_group_zeroes_every_step_of_the_failed_group() -> None:
    result = group_relative_advantages(step_wise_batch(), failed_group_policy="mask_group")

    assert result.loss_masks == [[0, 0], [0, 0], [0, 0], [0], [1, 1], [1, 1], [1, 1], [1, 1]]
    assert result.advantages[:4] == [0.0] * 4
    assert result.advantages[4:] != [0.0] * 4


# The input is left alone.


def test_the_input_batch_is_not_modified_and_the_result_shares_no_lists_with_it() -> None:
    batch = hand_worked_batch()
    before = copy.deepcopy(batch)

    result = group_relative_advantages(batch, failed_group_policy="mask_group")
    kept = group_relative_advantages(batch, failed_group_policy="keep")
    kept.loss_masks[0][0] = 0

    assert batch == before
    assert all(mask is not original for mask, original in zip(kept.loss_masks, batch.loss_masks, strict=True))
    assert result.loss_masks != batch.loss_masks


def test_the_result_pickles() -> None:
    result = group_relative_advantages(hand_worked_batch())

    assert pickle.loads(pickle.dumps(result)) == result


# Bad input.


def test_an_unknown_failed_group_policy_raises_unsupported_config_error() -> None:
    with pytest.raises(UnsupportedConfigError) as caught:
        group_relative_advantages(hand_worked_batch(), failed_group_policy="drop")  # type: ignore[arg-type]

    assert (
        str(caught.value)
        == "failed_group_policy: unknown policy 'drop', expected one of 'keep', 'mask_group'"
    )
    assert caught.value.option == "failed_group_policy"
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("epsilon", [-1e-6, math.nan, math.inf])
def test_a_negative_or_non_finite_epsilon_raises_unsupported_config_error(epsilon: float) -> None:
    with pytest.raises(UnsupportedConfigError) as caught:
        group_relative_advantages(hand_worked_batch(), epsilon=epsilon)

    assert str(caught.value) == f"epsilon: {epsilon!r} is not a finite number >= 0"


def test_rows_without_trajectory_ids_raise_output_validation_error_naming_each_row() -> None:
    batch = hand_worked_batch()
    batch.trajectory_ids[1] = None
    batch.trajectory_ids[4] = None

    with pytest.raises(OutputValidationError) as caught:
        group_relative_advantages(batch)

    reason = (
        "trajectory_ids is None; group-relative advantages group rows by instance id, so every row needs one"
    )
    assert caught.value.problems == (f"sample 1: {reason}", f"sample 4: {reason}")


def test_malformed_columns_raise_output_validation_error_listing_every_problem() -> None:
    batch = hand_worked_batch()
    batch.is_placeholder.pop()
    batch.rewards[0] = math.nan

    with pytest.raises(OutputValidationError) as caught:
        group_relative_advantages(batch)

    assert caught.value.problems == (
        "batch: is_placeholder has 5 rows but response_ids has 6",
        "sample 0: rewards is nan (float), expected a finite number",
    )


def test_a_step_wise_batch_that_does_not_end_a_trajectory_raises_output_validation_error() -> None:
    batch = step_wise_batch()
    assert batch.is_last_step is not None
    batch.is_last_step[-1] = False

    with pytest.raises(OutputValidationError) as caught:
        group_relative_advantages(batch)

    assert caught.value.problems == (
        "sample 7: is_last_step is False but the last row must end its trajectory",
    )


def test_a_token_level_reward_not_as_long_as_its_response_raises_output_validation_error() -> None:
    batch = build_batch_output([real("a", 0, [1.0]), real("a", 1, [0.0, 0.0])])

    with pytest.raises(OutputValidationError) as caught:
        group_relative_advantages(batch)

    assert caught.value.problems == ("sample 0: rewards has 1 entries but response_ids has 2",)


# Properties.

rewards = st.floats(min_value=-10.0, max_value=10.0, allow_nan=False, allow_infinity=False)
groups = st.lists(
    # Per group: its real rewards, and where among them to put each placeholder.
    st.tuples(st.lists(rewards, max_size=6), st.lists(st.integers(min_value=0, max_value=6), max_size=3)),
    min_size=1,
    max_size=5,
)
GroupSpec = list[tuple[list[float], list[int]]]


def build(spec: GroupSpec, *, with_placeholders: bool, step_wise: bool, steps: int) -> BatchOutput:
    """One group per spec entry; step-wise, each real trajectory gets ``steps`` earlier steps (reward 5.0)."""
    trajectories: list[AnyTrajectory] = []
    for group, (real_rewards, positions) in enumerate(spec):
        instance = f"p{group}"
        members = [real(instance, i, reward) for i, reward in enumerate(real_rewards)]
        if with_placeholders:
            for k, position in enumerate(positions):
                members.insert(position % (len(members) + 1), placeholder(instance, 100 + k))
        for member in members:
            if not step_wise:
                trajectories.append(member)
                continue
            tid = member.trajectory_id
            assert tid is not None
            earlier = (
                [] if member.is_placeholder else [real(instance, tid.repetition, 5.0) for _ in range(steps)]
            )
            trajectories.append(
                StepWiseTrajectory(
                    steps=[*earlier, member], trajectory_id=tid, is_placeholder=member.is_placeholder
                )
            )
    return build_batch_output(trajectories)


@settings(max_examples=200, deadline=None)
@given(
    spec=groups,
    step_wise=st.booleans(),
    steps=st.integers(min_value=0, max_value=2),
    normalize_std=st.booleans(),
)
def test_with_exclusion_adding_placeholders_never_changes_the_real_rows_advantages(
    spec: GroupSpec, step_wise: bool, steps: int, normalize_std: bool
) -> None:
    clean = build(spec, with_placeholders=False, step_wise=step_wise, steps=steps)
    failed = build(spec, with_placeholders=True, step_wise=step_wise, steps=steps)
    is_real = [not flag for flag in failed.is_placeholder]

    expected = group_relative_advantages(clean, normalize_std=normalize_std).advantages
    result = group_relative_advantages(failed, normalize_std=normalize_std)

    # Bit for bit: the exact statistics see the same real rewards.
    assert [a for a, keep in zip(result.advantages, is_real, strict=True) if keep] == expected
    assert all(a == 0.0 for a, keep in zip(result.advantages, is_real, strict=True) if not keep)


@settings(max_examples=200, deadline=None)
@given(spec=groups)
def test_each_groups_real_advantages_are_centred_and_scaled_by_the_sample_std(
    spec: GroupSpec,
) -> None:
    batch = build(spec, with_placeholders=True, step_wise=False, steps=0)
    is_real = [not flag for flag in batch.is_placeholder]

    result = group_relative_advantages(batch, epsilon=0.0)

    for stats in result.groups.values():
        values = [result.advantages[row] for row in stats.rows if is_real[row]]
        if len(values) < 2 or stats.std == 0.0:
            assert values == [0.0] * len(values)
            continue
        assume(stats.std is not None and stats.std > 1e-9)  # subnormal spreads lose precision in the division
        assert math.fsum(values) == pytest.approx(0.0, abs=1e-9)
        # Standardised by the sample std, the advantages have sample variance 1.
        assert math.fsum(v * v for v in values) / (len(values) - 1) == pytest.approx(1.0, rel=1e-9)


# What it reads: what the validator reads.


def test_a_generator_output_dict_gives_the_advantages_of_its_batch() -> None:
    batch = build_batch_output([real("a", 0, 1.0), real("a", 1, 0.0), placeholder("a", 2), real("b", 0, 1.0)])
    as_dict = batch.to_dict()
    validate_batch_output(as_dict, num_prompts=4)
    from_dict, from_batch = group_relative_advantages(as_dict), group_relative_advantages(batch)
    assert from_dict.advantages == from_batch.advantages
    assert from_dict.failed_groups == from_batch.failed_groups == ("a",)


def test_a_batch_with_the_default_empty_placeholder_flags_has_no_placeholders() -> None:
    batch = build_batch_output([real("a", 0, 1.0), real("a", 1, 0.0)])
    unflagged = dataclasses.replace(batch, is_placeholder=[])
    validate_batch_output(unflagged, num_prompts=2)
    assert group_relative_advantages(unflagged).advantages == group_relative_advantages(batch).advantages


def test_a_rollout_error_row_not_flagged_a_placeholder_is_refused_as_the_validator_refuses_it() -> None:
    """Otherwise its zero reward would enter its group's statistics, and the advantages of the batch and of
    its GeneratorOutput dict (where that row is a placeholder) would differ."""
    batch = build_batch_output([real("a", 0, 1.0), real("a", 1, 0.0), placeholder("a", 2)])
    unflagged = dataclasses.replace(batch, is_placeholder=[])
    with pytest.raises(OutputValidationError, match="sample 2: stop_reasons is 'rollout_error' but"):
        validate_batch_output(unflagged, num_prompts=3)
    with pytest.raises(OutputValidationError, match="sample 2: stop_reasons is 'rollout_error' but"):
        group_relative_advantages(unflagged)


def test_a_dict_without_a_column_names_it_and_anything_else_is_a_type_error() -> None:
    as_dict = build_batch_output([real("a", 0, 1.0)]).to_dict()
    del as_dict["loss_masks"]
    with pytest.raises(OutputValidationError, match="loss_masks"):
        group_relative_advantages(as_dict)
    with pytest.raises(TypeError, match=r"^group_relative_advantages expects a BatchOutput or a mapping"):
        group_relative_advantages([1, 2, 3])  # type: ignore[arg-type]
