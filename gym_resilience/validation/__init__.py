"""The bundled validator for ``BatchOutput`` and for SkyRL's ``GeneratorOutput`` dict.

``validate_batch_output`` runs every ``check_*`` function and raises one ``OutputValidationError`` that
lists every problem found, not just the first. Each check tests one invariant and returns the problems it
found as strings; checks never raise on malformed input, they report it. A ``GeneratorOutput`` dict is
read as ``BatchOutput.from_dict`` reads it and held to the same checks.

Every problem reads ``"<where>: <column> <what is wrong>"``, where ``<where>`` is ``sample <index>`` for
one row and ``batch`` for the batch as a whole, e.g. ``sample 3: loss_masks has 4 entries but response_ids
has 5``. A bad value is shown as its repr followed by its type name in parentheses (lists: repr only),
e.g. ``sample 2: rewards is nan (float), expected a finite number``. Within one row and column only the
first bad entry is reported, so a corrupt row cannot flood the error.

The checks live by what they check: ``columns.py`` (columns and rows), ``placeholders.py`` (placeholder
rows), ``steps.py`` (step-wise batches); ``values.py`` finds and shows a bad value.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Final

from gym_resilience.errors import OutputValidationError
from gym_resilience.trajectories import BatchOutput
from gym_resilience.validation.columns import (
    OPTIONAL_COLUMNS,
    REQUIRED_COLUMNS,
    batch_size,
    check_all_or_no_trajectory_level_rewards,
    check_batch_not_empty,
    check_batch_size,
    check_column_lengths,
    check_columns_are_lists,
    check_env_metrics_rows,
    check_generation_times,
    check_is_placeholder_types,
    check_logprob_lengths,
    check_logprob_values,
    check_loss_mask_lengths,
    check_loss_mask_values,
    check_prompts_not_empty,
    check_responses_not_empty,
    check_reward_values,
    check_rows_are_lists,
    check_stop_reason_types,
    check_time_splits,
    check_token_ids,
    check_token_level_reward_lengths,
    check_trajectory_id_types,
)
from gym_resilience.validation.placeholders import (
    check_placeholder_logprobs,
    check_placeholder_loss_masks,
    check_placeholder_responses,
    check_placeholder_rewards,
    check_placeholder_stop_reasons,
    check_rollout_errors_are_placeholders,
)
from gym_resilience.validation.steps import (
    check_is_last_step_matches_trajectory_ids,
    check_is_last_step_present,
    check_is_last_step_types,
    check_last_row_ends_trajectory,
    check_placeholders_are_one_step,
    check_step_trajectory_ids_present,
    check_steps_contiguous,
)

__all__ = [
    "CHECKS",
    "OPTIONAL_COLUMNS",
    "REQUIRED_COLUMNS",
    "STEP_WISE_CHECKS",
    "Check",
    "OutputValidationWarning",
    "as_batch_output",
    "check_all_or_no_trajectory_level_rewards",
    "check_batch_not_empty",
    "check_batch_size",
    "check_column_lengths",
    "check_columns_are_lists",
    "check_env_metrics_rows",
    "check_generation_times",
    "check_is_last_step_matches_trajectory_ids",
    "check_is_last_step_present",
    "check_is_last_step_types",
    "check_is_placeholder_types",
    "check_last_row_ends_trajectory",
    "check_logprob_lengths",
    "check_logprob_values",
    "check_loss_mask_lengths",
    "check_loss_mask_values",
    "check_placeholder_logprobs",
    "check_placeholder_loss_masks",
    "check_placeholder_responses",
    "check_placeholder_rewards",
    "check_placeholder_stop_reasons",
    "check_placeholders_are_one_step",
    "check_prompts_not_empty",
    "check_responses_not_empty",
    "check_reward_values",
    "check_rollout_errors_are_placeholders",
    "check_rows_are_lists",
    "check_step_trajectory_ids_present",
    "check_steps_contiguous",
    "check_stop_reason_types",
    "check_time_splits",
    "check_token_ids",
    "check_token_level_reward_lengths",
    "check_trajectory_id_types",
    "validate_batch_output",
]


class OutputValidationWarning(UserWarning):
    """Warned when a ``BatchOutput`` is valid but likely useless for training.

    Today: every loss mask of the batch is all zeros, so no token is trained on and the loss may be NaN.
    Check the generation logic (or the failure rate, if the batch is mostly placeholders).
    """


Check = Callable[[BatchOutput], list[str]]

CHECKS: Final[tuple[Check, ...]] = (
    check_batch_not_empty,
    check_columns_are_lists,
    check_column_lengths,
    check_rows_are_lists,
    check_prompts_not_empty,
    check_responses_not_empty,
    check_loss_mask_lengths,
    check_token_level_reward_lengths,
    check_logprob_lengths,
    check_all_or_no_trajectory_level_rewards,
    check_token_ids,
    check_loss_mask_values,
    check_reward_values,
    check_logprob_values,
    check_stop_reason_types,
    check_is_placeholder_types,
    check_trajectory_id_types,
    check_generation_times,
    check_env_metrics_rows,
    check_time_splits,
    check_placeholder_responses,
    check_placeholder_loss_masks,
    check_placeholder_rewards,
    check_placeholder_stop_reasons,
    check_placeholder_logprobs,
    check_rollout_errors_are_placeholders,
)
"""Checks for every batch; ``check_batch_size`` also runs unless step-wise."""

STEP_WISE_CHECKS: Final[tuple[Check, ...]] = (
    check_is_last_step_present,
    check_is_last_step_types,
    check_last_row_ends_trajectory,
    check_step_trajectory_ids_present,
    check_steps_contiguous,
    check_is_last_step_matches_trajectory_ids,
    check_placeholders_are_one_step,
)
"""Checks that run in step-wise mode only."""


def as_batch_output(output: object, reader: str) -> tuple[BatchOutput, list[str]]:
    """The ``BatchOutput`` that ``reader`` (a function's name, for the error) reads from ``output``: a
    ``BatchOutput``, or a mapping read as ``BatchOutput.from_dict`` reads it. With it, the problems found
    on the way (the keys a mapping lacks).

    An empty ``is_placeholder`` (the field's default) means no placeholders: it becomes all False.

    Raises:
        TypeError: ``output`` is neither.
    """
    problems: list[str] = []
    if isinstance(output, Mapping):
        problems = BatchOutput.missing_keys(output)
        output = BatchOutput.from_mapping_unchecked(output)
    elif not isinstance(output, BatchOutput):
        raise TypeError(
            f"{reader} expects a BatchOutput or a mapping with the keys of SkyRL's "
            f"GeneratorOutput, got {type(output).__name__}"
        )
    flags, size = getattr(output, "is_placeholder", None), batch_size(output)
    if size and isinstance(flags, list) and not flags:
        output = replace(output, is_placeholder=[False] * size)
    return output, problems


def validate_batch_output(
    output: BatchOutput | Mapping[str, Any], num_prompts: int, *, step_wise: bool = False
) -> None:
    """Check that ``output`` meets the contract a trainer relies on.

    ``output`` is a ``BatchOutput`` or SkyRL's ``GeneratorOutput`` dict (``BatchOutput.to_dict()``'s, or
    one SkyRL's generator made), read as ``BatchOutput.from_dict`` reads it: its placeholders are the
    ``"rollout_error"`` rows. A dict that lacks a required key is reported by those keys alone.
    ``num_prompts`` is the number of rows the trainer sent (tasks x samples per task); a step-wise batch
    has one row per step, so its size is not compared with it.

    Raises:
        OutputValidationError: listing every problem found, each naming the sample (or ``batch``) and
            the column.
        TypeError: ``output`` is neither a ``BatchOutput`` nor a mapping.

    Warns:
        OutputValidationWarning: when the batch is valid but every loss mask is all zeros.

    Example:
        >>> from gym_resilience.trajectories import Trajectory, build_batch_output
        >>> row = Trajectory(
        ...     prompt_ids=[1], response_ids=[2, 3], reward=1.0, loss_mask=[1, 1], stop_reason="stop"
        ... )
        >>> validate_batch_output(build_batch_output([row]), num_prompts=1)
        >>> validate_batch_output(build_batch_output([row]).to_dict(), num_prompts=1)
    """
    batch, problems = as_batch_output(output, "validate_batch_output")
    if problems:
        raise OutputValidationError(problems)
    for check in CHECKS:
        problems.extend(check(batch))
    if step_wise:
        for check in STEP_WISE_CHECKS:
            problems.extend(check(batch))
    else:
        problems.extend(check_batch_size(batch, num_prompts))
    if problems:
        raise OutputValidationError(problems)
    if not any(map(any, batch.loss_masks)):
        warnings.warn(
            "every loss mask in the batch is all zeros: no token will be trained on and the loss may be NaN",
            OutputValidationWarning,
            stacklevel=2,
        )
