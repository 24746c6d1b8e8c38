"""Group-relative (GRPO) advantages that placeholders cannot bias.

GRPO samples several responses per prompt (a *group*) and scores each against its siblings::

    advantage_i = (r_i - mean(group)) / (std(group) + epsilon)

A placeholder (a failed rollout, reward 0.0, loss mask ``[0]``) contributes no loss of its own, but if its
0.0 enters ``mean`` and ``std`` it still shifts every sibling's advantage: in a group of rewards
``[1, 0, 1]`` plus one placeholder, the mean drops from 2/3 to 1/2, so the two successes look better and
the failure looks less bad than they are. ``group_relative_advantages`` keeps placeholders out of the group
statistics (``exclude_placeholders=True``, the default), and can also drop a failed group from the loss
altogether (``failed_group_policy="mask_group"``), for trainers that would rather not learn from a group
that lost a sample.

Conventions:
    - A group is every row whose ``trajectory_ids[i].instance_id`` is the same: the samples of one prompt.
      Every row needs a trajectory id.
    - A row's scalar reward is its float, or the sum of its token-level list (as verl and SkyRL do).
    - ``std`` is the *sample* standard deviation (Bessel's correction, divisor n - 1), the default of
      ``torch.std`` that verl's and SkyRL's ``compute_grpo_outcome_advantage`` use. With
      ``normalize_std=False`` the advantage is ``r_i - mean(group)`` (Dr. GRPO).
    - A group with fewer than two samples in its statistics (one real row, or only placeholders) has no
      relative signal: its rows get advantage 0.0. (verl instead gives a lone sample its raw reward.)
    - A placeholder's own advantage is always 0.0; ``exclude_placeholders`` only decides whether its reward
      enters its group's mean and std.
    - Step-wise batches (``is_last_step`` set): a sample is a whole trajectory (the rows up to and including
      a row with ``is_last_step`` True), its scalar reward is that last step's reward (the outcome), and its
      advantage is broadcast to every step. Rewards of earlier steps do not count.

Means and standard deviations are computed exactly (``statistics`` works in fractions), so a group's
advantages do not depend on the order of its rows, and adding placeholders to a group leaves its real rows'
advantages bit for bit unchanged when they are excluded.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

from gym_resilience.errors import OutputValidationError, UnsupportedConfigError
from gym_resilience.trajectories import BatchOutput, TrajectoryId
from gym_resilience.validation import (
    as_batch_output,
    check_all_or_no_trajectory_level_rewards,
    check_column_lengths,
    check_columns_are_lists,
    check_is_last_step_matches_trajectory_ids,
    check_is_last_step_types,
    check_is_placeholder_types,
    check_last_row_ends_trajectory,
    check_loss_mask_lengths,
    check_placeholders_are_one_step,
    check_reward_values,
    check_rollout_errors_are_placeholders,
    check_rows_are_lists,
    check_token_level_reward_lengths,
    check_trajectory_id_types,
)

__all__ = ["FailedGroupPolicy", "GroupAdvantages", "GroupStats", "group_relative_advantages"]

FailedGroupPolicy = Literal["keep", "mask_group"]
"""What to do with a group that lost a rollout: ``keep`` trains on its real rows; ``mask_group`` zeroes the
loss masks (and advantages) of every row of the group."""

_POLICIES: Final = get_args(FailedGroupPolicy)


@dataclass(frozen=True, slots=True)
class GroupStats:
    """The statistics of one group (the samples of one prompt).

    ``rows`` are the batch rows of the group (step-wise: every step of its trajectories). ``num_samples``
    counts its samples (trajectories) and ``num_placeholders`` the failed ones among them. ``mean`` and
    ``std`` are over the samples that entered the statistics: None when there were none (``mean``) or
    fewer than two (``std``). ``std`` is None too when ``normalize_std`` is False.
    """

    instance_id: str
    rows: tuple[int, ...]
    num_samples: int
    num_placeholders: int
    mean: float | None
    std: float | None
    masked: bool


@dataclass(frozen=True, slots=True)
class GroupAdvantages:
    """Per-row advantages and the loss masks to train with.

    Every list is new: the ``BatchOutput`` the advantages were computed from is never modified, and
    editing these lists leaves it alone.

    Attributes:
        advantages: one float per row (step-wise: the trajectory's advantage on each of its steps).
        token_advantages: per row, the row's advantage repeated over its response tokens. Combine with
            ``loss_masks`` in the loss; env-written tokens are not zeroed here.
        loss_masks: per row, a copy of the input loss mask, or all zeros for a masked group.
        groups: the statistics of each group, by instance id, in order of first appearance.
        failed_groups: instance ids of the groups that contain a placeholder, in order of first appearance.
        masked_groups: instance ids of the groups whose loss masks were zeroed (``mask_group`` only).
    """

    advantages: list[float]
    token_advantages: list[list[float]]
    loss_masks: list[list[int]]
    groups: dict[str, GroupStats]
    failed_groups: tuple[str, ...]
    masked_groups: tuple[str, ...]


def _check_trajectory_ids_present(output: BatchOutput) -> list[str]:
    """Every row has a trajectory id: rows are grouped by its instance id."""
    ids = getattr(output, "trajectory_ids", None)
    return [
        f"sample {index}: trajectory_ids is None; group-relative advantages group rows by instance id, "
        "so every row needs one"
        for index, tid in enumerate(ids if isinstance(ids, list) else [])
        if tid is None
    ]


_CHECKS: Final[tuple[Callable[[BatchOutput], list[str]], ...]] = (
    check_columns_are_lists,
    check_column_lengths,
    check_rows_are_lists,
    check_loss_mask_lengths,
    check_token_level_reward_lengths,
    check_reward_values,
    check_all_or_no_trajectory_level_rewards,
    check_is_placeholder_types,
    check_trajectory_id_types,
    check_rollout_errors_are_placeholders,
    _check_trajectory_ids_present,
)
"""The invariants the computation relies on (a subset of the validator's, plus ids on every row): a
``"rollout_error"`` row that is not flagged a placeholder would enter its group's statistics."""

_STEP_WISE_CHECKS: Final[tuple[Callable[[BatchOutput], list[str]], ...]] = (
    check_is_last_step_types,
    check_last_row_ends_trajectory,
    check_is_last_step_matches_trajectory_ids,
    check_placeholders_are_one_step,
)
"""What step-wise grouping relies on: a trajectory is the rows up to a row with ``is_last_step`` True."""


def _checked_input(output: BatchOutput | Mapping[str, Any]) -> BatchOutput:
    """``output`` read as the validator reads it (a GeneratorOutput dict too), if the computation can
    use it."""
    batch, problems = as_batch_output(output, "group_relative_advantages")
    if problems:
        raise OutputValidationError(problems)
    # Like the validator's, these checks report malformed input instead of raising, so all of them run.
    checks = _CHECKS
    if getattr(batch, "is_last_step", None) is not None:
        checks += _STEP_WISE_CHECKS
    problems = [problem for check in checks for problem in check(batch)]
    if problems:
        raise OutputValidationError(problems)
    return batch


def _check_options(*, epsilon: float, failed_group_policy: str) -> None:
    if failed_group_policy not in _POLICIES:
        raise UnsupportedConfigError(
            f"unknown policy {failed_group_policy!r}, expected one of {', '.join(map(repr, _POLICIES))}",
            option="failed_group_policy",
        )
    if not (isinstance(epsilon, int | float) and math.isfinite(epsilon) and epsilon >= 0):
        raise UnsupportedConfigError(f"{epsilon!r} is not a finite number >= 0", option="epsilon")


def _scalar(reward: float | list[float]) -> float:
    return math.fsum(reward) if isinstance(reward, list) else float(reward)


@dataclass(slots=True)
class _Sample:
    """One sample of a group: its rows (step-wise: its steps), outcome reward and whether it failed."""

    rows: list[int]
    reward: float
    is_placeholder: bool


def _samples(output: BatchOutput) -> list[_Sample]:
    if output.is_last_step is None:
        return [
            _Sample([index], _scalar(reward), flag)
            for index, (reward, flag) in enumerate(zip(output.rewards, output.is_placeholder, strict=True))
        ]
    samples: list[_Sample] = []
    rows: list[int] = []
    for index, last in enumerate(output.is_last_step):
        rows.append(index)
        if last:
            placeholder = any(output.is_placeholder[row] for row in rows)
            samples.append(_Sample(rows, _scalar(output.rewards[index]), placeholder))
            rows = []
    return samples


def _instance_id(output: BatchOutput, sample: _Sample) -> str:
    tid = output.trajectory_ids[sample.rows[-1]]
    if not isinstance(tid, TrajectoryId):  # _check_input has ruled this out
        raise TypeError(f"sample {sample.rows[-1]}: trajectory_ids is {tid!r}, expected a TrajectoryId")
    return tid.instance_id


def _group_advantages(
    rewards: list[float], *, normalize_std: bool, epsilon: float
) -> tuple[list[float], float | None, float | None]:
    """The advantages of rewards that form one group's statistics, with the group's mean and std."""
    if not rewards:
        return [], None, None
    mean = statistics.mean(rewards)
    if len(rewards) < 2:
        return [0.0], mean, None
    centered = [reward - mean for reward in rewards]
    if not normalize_std:
        return centered, mean, None
    std = statistics.stdev(rewards, xbar=mean)
    denominator = std + epsilon
    if denominator == 0.0:
        # std is 0 only when every reward is equal, so every centered reward is 0 already.
        return [0.0] * len(rewards), mean, std
    return [value / denominator for value in centered], mean, std


def group_relative_advantages(
    output: BatchOutput | Mapping[str, Any],
    *,
    normalize_std: bool = True,
    epsilon: float = 1e-6,
    exclude_placeholders: bool = True,
    failed_group_policy: FailedGroupPolicy = "keep",
) -> GroupAdvantages:
    """GRPO advantages per row, with placeholders kept out of their group's mean and std.

    Args:
        output: the batch, trajectory-level or token-level rewards, one row per sample or (step-wise) per
            step: a ``BatchOutput``, or SkyRL's ``GeneratorOutput`` dict, read as ``validate_batch_output``
            reads it. It is not modified.
        normalize_std: divide by the group's sample std plus ``epsilon`` (GRPO); False: only subtract the
            group mean (Dr. GRPO).
        epsilon: added to the std before dividing, a finite number >= 0.
        exclude_placeholders: keep placeholders' rewards out of their group's statistics. False reproduces
            a plain GRPO implementation run on the batch, bias included.
        failed_group_policy: ``"keep"`` trains on a failed group's real rows; ``"mask_group"`` zeroes the
            loss mask and the advantage of every row of a group that contains a placeholder.

    Returns:
        The advantages, per-token advantages, the loss masks to train with and each group's statistics.

    Raises:
        UnsupportedConfigError: ``failed_group_policy`` is unknown or ``epsilon`` is negative or not finite.
        OutputValidationError: a row has no trajectory id, or the columns the computation reads are
            malformed (lengths, reward values, step-wise structure) or missing, listing every problem found.
        TypeError: ``output`` is neither a ``BatchOutput`` nor a mapping.

    Example:
        >>> from gym_resilience.trajectories import Trajectory, TrajectoryId, build_batch_output
        >>> def row(reward, repetition, placeholder=False):
        ...     return Trajectory(
        ...         prompt_ids=[1], response_ids=[2], reward=reward, loss_mask=[0 if placeholder else 1],
        ...         stop_reason="rollout_error" if placeholder else "stop",
        ...         trajectory_id=TrajectoryId("q", repetition), is_placeholder=placeholder,
        ...     )
        >>> batch = build_batch_output([row(1.0, 0), row(0.0, 1), row(0.0, 2, placeholder=True)])
        >>> [round(a, 3) for a in group_relative_advantages(batch).advantages]
        [0.707, -0.707, 0.0]
        >>> [round(a, 3) for a in group_relative_advantages(batch, exclude_placeholders=False).advantages]
        [1.155, -0.577, 0.0]
    """
    _check_options(epsilon=epsilon, failed_group_policy=failed_group_policy)
    output = _checked_input(output)

    samples_by_group: dict[str, list[_Sample]] = {}
    for sample in _samples(output):
        samples_by_group.setdefault(_instance_id(output, sample), []).append(sample)

    advantages = [0.0] * len(output.response_ids)
    loss_masks = [list(mask) for mask in output.loss_masks]
    groups: dict[str, GroupStats] = {}
    for instance_id, samples in samples_by_group.items():
        failed = any(sample.is_placeholder for sample in samples)
        masked = failed and failed_group_policy == "mask_group"
        counted = [s for s in samples if not (exclude_placeholders and s.is_placeholder)]
        values, mean, std = _group_advantages(
            [s.reward for s in counted], normalize_std=normalize_std, epsilon=epsilon
        )
        rows = tuple(sorted(row for sample in samples for row in sample.rows))
        if masked:
            for row in rows:
                loss_masks[row] = [0] * len(loss_masks[row])
        else:
            for sample, value in zip(counted, values, strict=True):
                if not sample.is_placeholder:
                    for row in sample.rows:
                        advantages[row] = value
        groups[instance_id] = GroupStats(
            instance_id=instance_id,
            rows=rows,
            num_samples=len(samples),
            num_placeholders=sum(1 for sample in samples if sample.is_placeholder),
            mean=mean,
            std=std,
            masked=masked,
        )

    return GroupAdvantages(
        advantages=advantages,
        token_advantages=[
            [advantage] * len(response)
            for advantage, response in zip(advantages, output.response_ids, strict=True)
        ],
        loss_masks=loss_masks,
        groups=groups,
        failed_groups=tuple(i for i, stats in groups.items() if stats.num_placeholders),
        masked_groups=tuple(i for i, stats in groups.items() if stats.masked),
    )
