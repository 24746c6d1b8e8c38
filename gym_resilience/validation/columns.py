"""The validator's checks of columns and rows: present, lists of one length, of well-typed values."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Final

from gym_resilience.trajectories import BatchOutput, TrajectoryId
from gym_resilience.validation.values import (
    first_bad_mask_value,
    first_bad_number,
    first_bad_token,
    is_finite_real,
    is_real,
    show,
)

__all__ = [
    "OPTIONAL_COLUMNS",
    "REQUIRED_COLUMNS",
    "batch_size",
    "check_all_or_no_trajectory_level_rewards",
    "check_batch_not_empty",
    "check_batch_size",
    "check_column_lengths",
    "check_columns_are_lists",
    "check_env_metrics_rows",
    "check_generation_times",
    "check_is_placeholder_types",
    "check_logprob_lengths",
    "check_logprob_values",
    "check_loss_mask_lengths",
    "check_loss_mask_values",
    "check_prompts_not_empty",
    "check_responses_not_empty",
    "check_reward_values",
    "check_rows_are_lists",
    "check_stop_reason_types",
    "check_time_splits",
    "check_token_ids",
    "check_token_level_reward_lengths",
    "check_trajectory_id_types",
    "column",
    "is_well_formed",
    "list_rows",
]

REQUIRED_COLUMNS: Final = (
    "prompt_token_ids",
    "response_ids",
    "rewards",
    "loss_masks",
    "stop_reasons",
    "trajectory_ids",
    "is_placeholder",
)
"""Per-sample columns every batch has."""

OPTIONAL_COLUMNS: Final = (
    "rollout_logprobs",
    "trajectory_generation_times",
    "is_last_step",
    "env_metrics",
    "rollout_expert_indices",
)
"""Per-sample columns that may be None (``is_last_step`` is required in step-wise mode)."""

_NESTED_COLUMNS: Final = ("prompt_token_ids", "response_ids", "loss_masks", "rollout_logprobs")
"""Per-sample columns whose rows are lists."""


# Reading columns without raising.


def column(output: BatchOutput, name: str) -> list[Any]:
    """The column's rows, or [] when it is None or not a list (``check_columns_are_lists`` reports it)."""
    rows = getattr(output, name, None)
    return rows if isinstance(rows, list) else []


def list_rows(output: BatchOutput, name: str) -> Iterator[tuple[int, list[Any]]]:
    """Each row of a nested column that is a list (``check_rows_are_lists`` reports the others)."""
    for index, row in enumerate(column(output, name)):
        if isinstance(row, list):
            yield index, row


def batch_size(output: BatchOutput) -> int | None:
    """The number of rows of ``response_ids``; None when it is not a list."""
    response_ids = getattr(output, "response_ids", None)
    return len(response_ids) if isinstance(response_ids, list) else None


# Batch-level checks.


def check_batch_not_empty(output: BatchOutput) -> list[str]:
    """The batch has at least one sample."""
    if batch_size(output) == 0:
        return ["batch: response_ids has no rows; a batch needs at least one sample"]
    return []


def check_batch_size(output: BatchOutput, num_prompts: int) -> list[str]:
    """The batch has one row per prompt the trainer sent (tasks x samples); not for step-wise batches."""
    size = batch_size(output)
    if size is not None and size != num_prompts:
        return [f"batch: response_ids has {size} rows but num_prompts is {num_prompts}"]
    return []


def check_columns_are_lists(output: BatchOutput) -> list[str]:
    """Every per-sample column is a list (optional ones may be None)."""
    problems = []
    for name in REQUIRED_COLUMNS + OPTIONAL_COLUMNS:
        rows = getattr(output, name, None)
        if name in OPTIONAL_COLUMNS and rows is None:
            continue
        if not isinstance(rows, list):
            problems.append(f"batch: {name} is {show(rows)}, expected a list")
    return problems


def check_column_lengths(output: BatchOutput) -> list[str]:
    """Every per-sample column has the batch's length (that of ``response_ids``)."""
    size = batch_size(output)
    if size is None:
        return []
    problems = []
    for name in REQUIRED_COLUMNS + OPTIONAL_COLUMNS:
        rows = getattr(output, name, None)
        if isinstance(rows, list) and len(rows) != size:
            problems.append(f"batch: {name} has {len(rows)} rows but response_ids has {size}")
    return problems


def check_all_or_no_trajectory_level_rewards(output: BatchOutput) -> list[str]:
    """Rewards are uniformly trajectory-level (numbers) or uniformly token-level (lists).

    The kind most rows have is taken as intended (ties: the first row's), and every other row is reported
    next to the first row of that kind.
    """
    kinds: list[tuple[int, bool]] = []  # (row, is token-level)
    for index, reward in enumerate(column(output, "rewards")):
        if isinstance(reward, list):
            kinds.append((index, True))
        elif is_real(reward):
            kinds.append((index, False))
    token_level = sum(1 for _, is_list in kinds if is_list)
    if token_level in (0, len(kinds)):
        return []
    majority = kinds[0][1] if token_level * 2 == len(kinds) else token_level * 2 > len(kinds)
    reference = next(index for index, is_list in kinds if is_list == majority)
    describe = {True: "token-level (a list)", False: "trajectory-level (a number)"}
    return [
        f"sample {index}: rewards is {describe[is_list]} but sample {reference}'s is {describe[majority]}; "
        "a batch's rewards must be all trajectory-level or all token-level"
        for index, is_list in kinds
        if is_list != majority
    ]


# Per-sample checks: shapes.


def check_rows_are_lists(output: BatchOutput) -> list[str]:
    """Rows of ``prompt_token_ids``, ``response_ids``, ``loss_masks`` and ``rollout_logprobs`` are lists."""
    return [
        f"sample {index}: {name} is {show(row)}, expected a list"
        for name in _NESTED_COLUMNS
        for index, row in enumerate(column(output, name))
        if not isinstance(row, list)
    ]


def check_prompts_not_empty(output: BatchOutput) -> list[str]:
    """Every prompt has at least one token."""
    return [
        f"sample {index}: prompt_token_ids is empty"
        for index, row in list_rows(output, "prompt_token_ids")
        if not row
    ]


def check_responses_not_empty(output: BatchOutput) -> list[str]:
    """Every response has at least one token."""
    return [
        f"sample {index}: response_ids is empty"
        for index, row in list_rows(output, "response_ids")
        if not row
    ]


def _length_problems(output: BatchOutput, name: str, rows: list[Any]) -> list[str]:
    problems = []
    for (index, response), row in zip(enumerate(column(output, "response_ids")), rows, strict=False):
        if isinstance(response, list) and isinstance(row, list) and len(row) != len(response):
            problems.append(
                f"sample {index}: {name} has {len(row)} entries but response_ids has {len(response)}"
            )
    return problems


def check_loss_mask_lengths(output: BatchOutput) -> list[str]:
    """Every loss mask is as long as its response."""
    return _length_problems(output, "loss_masks", column(output, "loss_masks"))


def check_token_level_reward_lengths(output: BatchOutput) -> list[str]:
    """Every token-level reward is as long as its response."""
    return _length_problems(output, "rewards", column(output, "rewards"))


def check_logprob_lengths(output: BatchOutput) -> list[str]:
    """Every row of ``rollout_logprobs`` (when the column exists) is as long as its response."""
    return _length_problems(output, "rollout_logprobs", column(output, "rollout_logprobs"))


# Per-sample checks: types and values.


def check_token_ids(output: BatchOutput) -> list[str]:
    """Prompt and response token ids are non-negative ints (not bools)."""
    problems = []
    for name in ("prompt_token_ids", "response_ids"):
        for index, row in list_rows(output, name):
            bad = first_bad_token(row)
            if bad is not None:
                problems.append(
                    f"sample {index}: {name}[{bad}] is {show(row[bad])}, expected a non-negative int token id"
                )
    return problems


def check_loss_mask_values(output: BatchOutput) -> list[str]:
    """Loss masks hold only the ints 0 and 1 (not bools)."""
    problems = []
    for index, mask in list_rows(output, "loss_masks"):
        bad = first_bad_mask_value(mask)
        if bad is not None:
            problems.append(f"sample {index}: loss_masks[{bad}] is {show(mask[bad])}, expected 0 or 1 (int)")
    return problems


def check_reward_values(output: BatchOutput) -> list[str]:
    """Rewards are finite real numbers (not bools, NaN or inf), or lists of them."""
    problems = []
    for index, reward in enumerate(column(output, "rewards")):
        if isinstance(reward, list):
            bad = first_bad_number(reward)
            if bad is not None:
                problems.append(
                    f"sample {index}: rewards[{bad}] is {show(reward[bad])}, expected a finite number"
                )
        elif not is_real(reward):
            problems.append(
                f"sample {index}: rewards is {show(reward)}, expected a finite number or a list of them"
            )
        elif not is_finite_real(reward):
            problems.append(f"sample {index}: rewards is {show(reward)}, expected a finite number")
    return problems


def check_logprob_values(output: BatchOutput) -> list[str]:
    """Rollout logprobs are finite numbers <= 0."""
    problems = []
    for index, logprobs in list_rows(output, "rollout_logprobs"):
        bad = first_bad_number(logprobs, at_most_zero=True)
        if bad is not None:
            problems.append(
                f"sample {index}: rollout_logprobs[{bad}] is {show(logprobs[bad])}, "
                "expected a finite number <= 0"
            )
    return problems


def check_stop_reason_types(output: BatchOutput) -> list[str]:
    """Stop reasons are strings."""
    return [
        f"sample {index}: stop_reasons is {show(reason)}, expected a str"
        for index, reason in enumerate(column(output, "stop_reasons"))
        if not isinstance(reason, str)
    ]


def check_is_placeholder_types(output: BatchOutput) -> list[str]:
    """``is_placeholder`` holds real bools."""
    return [
        f"sample {index}: is_placeholder is {show(flag)}, expected a bool"
        for index, flag in enumerate(column(output, "is_placeholder"))
        if not isinstance(flag, bool)
    ]


def check_trajectory_id_types(output: BatchOutput) -> list[str]:
    """Trajectory ids are ``TrajectoryId`` or None (step-wise batches also forbid None), each with a str
    ``instance_id`` and an int ``repetition``."""
    problems = []
    for index, tid in enumerate(column(output, "trajectory_ids")):
        if tid is not None and not isinstance(tid, TrajectoryId):
            problems.append(f"sample {index}: trajectory_ids is {show(tid)}, expected a TrajectoryId or None")
        elif tid is not None and not is_well_formed(tid):
            problems.append(
                f"sample {index}: trajectory_ids has instance_id {show(tid.instance_id)} and repetition "
                f"{show(tid.repetition)}, expected a str and an int"
            )
    return problems


def is_well_formed(tid: TrajectoryId) -> bool:
    """Whether the id's fields have their types: a str instance id and an int (not bool) repetition."""
    repetition = tid.repetition
    return (
        isinstance(tid.instance_id, str) and isinstance(repetition, int) and not isinstance(repetition, bool)
    )


def check_generation_times(output: BatchOutput) -> list[str]:
    """Generation times (when the column exists) are finite numbers >= 0."""
    return [
        f"sample {index}: trajectory_generation_times is {show(seconds)}, expected a finite number >= 0"
        for index, seconds in enumerate(column(output, "trajectory_generation_times"))
        if not (is_finite_real(seconds) and seconds >= 0)
    ]


def check_env_metrics_rows(output: BatchOutput) -> list[str]:
    """Rows of ``env_metrics`` (when the column exists) are dicts."""
    return [
        f"sample {index}: env_metrics is {show(row)}, expected a dict"
        for index, row in enumerate(column(output, "env_metrics"))
        if not isinstance(row, Mapping)
    ]


def check_time_splits(output: BatchOutput) -> list[str]:
    """``trajectory_time_splits`` is None or maps each part's name to one time per row, each >= 0."""
    splits = getattr(output, "trajectory_time_splits", None)
    if splits is None:
        return []
    if not isinstance(splits, Mapping):
        return [f"batch: trajectory_time_splits is {show(splits)}, expected a dict of lists or None"]
    size = batch_size(output)
    problems = []
    for name, times in splits.items():
        where = f"trajectory_time_splits[{name!r}]"
        if not isinstance(times, list):
            problems.append(f"batch: {where} is {show(times)}, expected a list")
            continue
        if size is not None and len(times) != size:
            problems.append(f"batch: {where} has {len(times)} rows but response_ids has {size}")
        problems.extend(
            f"sample {index}: {where} is {show(seconds)}, expected a finite number >= 0"
            for index, seconds in enumerate(times)
            if not (is_finite_real(seconds) and seconds >= 0)
        )
    return problems
