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

The validator runs on every training step, so per-token work is done with builtins that loop in C
(``set(map(type, ...))``, ``min``, ``any``) and falls back to a Python loop only to locate a bad entry.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from numbers import Real
from typing import Any, Final

from gym_resilience.errors import OutputValidationError
from gym_resilience.placeholders import PLACEHOLDER
from gym_resilience.trajectories import ROLLOUT_ERROR_STOP_REASON, BatchOutput, TrajectoryId

__all__ = ["OutputValidationWarning", "validate_batch_output"]


class OutputValidationWarning(UserWarning):
    """Warned when a ``BatchOutput`` is valid but likely useless for training.

    Today: every loss mask of the batch is all zeros, so no token is trained on and the loss may be NaN.
    Check the generation logic (or the failure rate, if the batch is mostly placeholders).
    """


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

_MAX_SHOWN: Final = 60


# Helpers.


def show(value: Any) -> str:
    text = repr(value)
    if len(text) > _MAX_SHOWN:
        text = text[: _MAX_SHOWN - 3] + "..."
    return text if isinstance(value, list) else f"{text} ({type(value).__name__})"


def _column(output: BatchOutput, name: str) -> list[Any]:
    """The column's rows, or [] when it is None or not a list (``check_columns_are_lists`` reports it)."""
    column = getattr(output, name, None)
    return column if isinstance(column, list) else []


def _lists(output: BatchOutput, name: str) -> Iterator[tuple[int, list[Any]]]:
    """Each row of a nested column that is a list (``check_rows_are_lists`` reports the others)."""
    for index, row in enumerate(_column(output, name)):
        if isinstance(row, list):
            yield index, row


def _is_real(value: Any) -> bool:
    return (
        type(value) is float
        or type(value) is int
        or (isinstance(value, Real) and not isinstance(value, bool))
    )


def _is_finite_real(value: Any) -> bool:
    try:
        return _is_real(value) and math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _equals(value: Any, expected: Any) -> bool:
    try:
        return bool(value == expected)
    except Exception:  # a foreign row (a numpy array) whose == is not one bool; other checks report it
        return False


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_mask_value(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value in (0, 1)


def _is_logprob(value: Any) -> bool:
    return _is_finite_real(value) and value <= 0


def _first_bad(values: list[Any], is_good: Callable[[Any], bool]) -> int | None:
    for index, value in enumerate(values):
        if not is_good(value):
            return index
    return None


def first_bad_token(ids: list[Any]) -> int | None:
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0):
        return None
    return _first_bad(ids, _is_token_id)


def _first_bad_mask_value(mask: list[Any]) -> int | None:
    # The type test matters: True == 1 and 1.0 == 1, so the value set alone would let them through.
    if not mask or (set(map(type, mask)) == {int} and set(mask) <= {0, 1}):
        return None
    return _first_bad(mask, _is_mask_value)


def first_bad_number(values: list[Any], *, at_most_zero: bool = False) -> int | None:
    if not values:
        return None
    try:
        # NaN and inf survive a sum; a sum that overflows only costs the slow path below.
        if (
            set(map(type, values)) <= {float, int}
            and math.isfinite(sum(values))
            and (not at_most_zero or max(values) <= 0)
        ):
            return None
    except OverflowError:
        pass
    return _first_bad(values, _is_logprob if at_most_zero else _is_finite_real)


def _batch_size(output: BatchOutput) -> int | None:
    response_ids = getattr(output, "response_ids", None)
    return len(response_ids) if isinstance(response_ids, list) else None


# Batch-level checks.


def check_batch_not_empty(output: BatchOutput) -> list[str]:
    """The batch has at least one sample."""
    if _batch_size(output) == 0:
        return ["batch: response_ids has no rows; a batch needs at least one sample"]
    return []


def check_batch_size(output: BatchOutput, num_prompts: int) -> list[str]:
    """The batch has one row per prompt the trainer sent (tasks x samples); not for step-wise batches."""
    size = _batch_size(output)
    if size is not None and size != num_prompts:
        return [f"batch: response_ids has {size} rows but num_prompts is {num_prompts}"]
    return []


def check_columns_are_lists(output: BatchOutput) -> list[str]:
    """Every per-sample column is a list (optional ones may be None)."""
    problems = []
    for name in REQUIRED_COLUMNS + OPTIONAL_COLUMNS:
        column = getattr(output, name, None)
        if name in OPTIONAL_COLUMNS and column is None:
            continue
        if not isinstance(column, list):
            problems.append(f"batch: {name} is {show(column)}, expected a list")
    return problems


def check_column_lengths(output: BatchOutput) -> list[str]:
    """Every per-sample column has the batch's length (that of ``response_ids``)."""
    size = _batch_size(output)
    if size is None:
        return []
    problems = []
    for name in REQUIRED_COLUMNS + OPTIONAL_COLUMNS:
        column = getattr(output, name, None)
        if isinstance(column, list) and len(column) != size:
            problems.append(f"batch: {name} has {len(column)} rows but response_ids has {size}")
    return problems


def check_all_or_no_trajectory_level_rewards(output: BatchOutput) -> list[str]:
    """Rewards are uniformly trajectory-level (numbers) or uniformly token-level (lists).

    The kind most rows have is taken as intended (ties: the first row's), and every other row is reported
    next to the first row of that kind.
    """
    kinds: list[tuple[int, bool]] = []  # (row, is token-level)
    for index, reward in enumerate(_column(output, "rewards")):
        if isinstance(reward, list):
            kinds.append((index, True))
        elif _is_real(reward):
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
        for index, row in enumerate(_column(output, name))
        if not isinstance(row, list)
    ]


def check_prompts_not_empty(output: BatchOutput) -> list[str]:
    """Every prompt has at least one token."""
    return [
        f"sample {index}: prompt_token_ids is empty"
        for index, row in _lists(output, "prompt_token_ids")
        if not row
    ]


def check_responses_not_empty(output: BatchOutput) -> list[str]:
    """Every response has at least one token."""
    return [
        f"sample {index}: response_ids is empty" for index, row in _lists(output, "response_ids") if not row
    ]


def _length_problems(output: BatchOutput, name: str, rows: list[Any]) -> list[str]:
    problems = []
    for (index, response), row in zip(enumerate(_column(output, "response_ids")), rows, strict=False):
        if isinstance(response, list) and isinstance(row, list) and len(row) != len(response):
            problems.append(
                f"sample {index}: {name} has {len(row)} entries but response_ids has {len(response)}"
            )
    return problems


def check_loss_mask_lengths(output: BatchOutput) -> list[str]:
    """Every loss mask is as long as its response."""
    return _length_problems(output, "loss_masks", _column(output, "loss_masks"))


def check_token_level_reward_lengths(output: BatchOutput) -> list[str]:
    """Every token-level reward is as long as its response."""
    return _length_problems(output, "rewards", _column(output, "rewards"))


def check_logprob_lengths(output: BatchOutput) -> list[str]:
    """Every row of ``rollout_logprobs`` (when the column exists) is as long as its response."""
    return _length_problems(output, "rollout_logprobs", _column(output, "rollout_logprobs"))


# Per-sample checks: types and values.


def check_token_ids(output: BatchOutput) -> list[str]:
    """Prompt and response token ids are non-negative ints (not bools)."""
    problems = []
    for name in ("prompt_token_ids", "response_ids"):
        for index, row in _lists(output, name):
            bad = first_bad_token(row)
            if bad is not None:
                problems.append(
                    f"sample {index}: {name}[{bad}] is {show(row[bad])}, expected a non-negative int token id"
                )
    return problems


def check_loss_mask_values(output: BatchOutput) -> list[str]:
    """Loss masks hold only the ints 0 and 1 (not bools)."""
    problems = []
    for index, mask in _lists(output, "loss_masks"):
        bad = _first_bad_mask_value(mask)
        if bad is not None:
            problems.append(f"sample {index}: loss_masks[{bad}] is {show(mask[bad])}, expected 0 or 1 (int)")
    return problems


def check_reward_values(output: BatchOutput) -> list[str]:
    """Rewards are finite real numbers (not bools, NaN or inf), or lists of them."""
    problems = []
    for index, reward in enumerate(_column(output, "rewards")):
        if isinstance(reward, list):
            bad = first_bad_number(reward)
            if bad is not None:
                problems.append(
                    f"sample {index}: rewards[{bad}] is {show(reward[bad])}, expected a finite number"
                )
        elif not _is_real(reward):
            problems.append(
                f"sample {index}: rewards is {show(reward)}, expected a finite number or a list of them"
            )
        elif not _is_finite_real(reward):
            problems.append(f"sample {index}: rewards is {show(reward)}, expected a finite number")
    return problems


def check_logprob_values(output: BatchOutput) -> list[str]:
    """Rollout logprobs are finite numbers <= 0."""
    problems = []
    for index, logprobs in _lists(output, "rollout_logprobs"):
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
        for index, reason in enumerate(_column(output, "stop_reasons"))
        if not isinstance(reason, str)
    ]


def check_is_placeholder_types(output: BatchOutput) -> list[str]:
    """``is_placeholder`` holds real bools."""
    return [
        f"sample {index}: is_placeholder is {show(flag)}, expected a bool"
        for index, flag in enumerate(_column(output, "is_placeholder"))
        if not isinstance(flag, bool)
    ]


def check_trajectory_id_types(output: BatchOutput) -> list[str]:
    """Trajectory ids are ``TrajectoryId`` or None (step-wise batches also forbid None), each with a str
    ``instance_id`` and an int ``repetition``."""
    problems = []
    for index, tid in enumerate(_column(output, "trajectory_ids")):
        if tid is not None and not isinstance(tid, TrajectoryId):
            problems.append(f"sample {index}: trajectory_ids is {show(tid)}, expected a TrajectoryId or None")
        elif tid is not None and not _is_well_formed(tid):
            problems.append(
                f"sample {index}: trajectory_ids has instance_id {show(tid.instance_id)} and repetition "
                f"{show(tid.repetition)}, expected a str and an int"
            )
    return problems


def _is_well_formed(tid: TrajectoryId) -> bool:
    repetition = tid.repetition
    return (
        isinstance(tid.instance_id, str) and isinstance(repetition, int) and not isinstance(repetition, bool)
    )


def check_generation_times(output: BatchOutput) -> list[str]:
    """Generation times (when the column exists) are finite numbers >= 0."""
    return [
        f"sample {index}: trajectory_generation_times is {show(seconds)}, expected a finite number >= 0"
        for index, seconds in enumerate(_column(output, "trajectory_generation_times"))
        if not (_is_finite_real(seconds) and seconds >= 0)
    ]


def check_env_metrics_rows(output: BatchOutput) -> list[str]:
    """Rows of ``env_metrics`` (when the column exists) are dicts."""
    return [
        f"sample {index}: env_metrics is {show(row)}, expected a dict"
        for index, row in enumerate(_column(output, "env_metrics"))
        if not isinstance(row, Mapping)
    ]


def check_time_splits(output: BatchOutput) -> list[str]:
    """``trajectory_time_splits`` is None or maps each part's name to one time per row, each >= 0."""
    splits = getattr(output, "trajectory_time_splits", None)
    if splits is None:
        return []
    if not isinstance(splits, Mapping):
        return [f"batch: trajectory_time_splits is {show(splits)}, expected a dict of lists or None"]
    size = _batch_size(output)
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
            if not (_is_finite_real(seconds) and seconds >= 0)
        )
    return problems


# Per-sample checks: placeholders.


def _placeholder_rows(output: BatchOutput) -> Iterator[int]:
    return (index for index, flag in enumerate(_column(output, "is_placeholder")) if flag is True)


def check_placeholder_responses(output: BatchOutput) -> list[str]:
    """A placeholder has exactly ``PLACEHOLDER.response_length`` (one) response token."""
    response_ids = _column(output, "response_ids")
    problems = []
    for index in _placeholder_rows(output):
        if (
            index < len(response_ids)
            and isinstance(response_ids[index], list)
            and len(response_ids[index]) != PLACEHOLDER.response_length
        ):
            count, expected = len(response_ids[index]), PLACEHOLDER.response_length
            problems.append(
                f"sample {index}: response_ids of a placeholder has {count} tokens, "
                f"expected exactly {expected}"
            )
    return problems


def check_placeholder_loss_masks(output: BatchOutput) -> list[str]:
    """A placeholder's loss mask is ``[0]``: nothing of it is trained on."""
    masks, expected = _column(output, "loss_masks"), PLACEHOLDER.loss_masks()
    return [
        f"sample {index}: loss_masks of a placeholder is {show(masks[index])}, expected {expected}"
        for index in _placeholder_rows(output)
        if index < len(masks) and not _equals(masks[index], expected)
    ]


def check_placeholder_rewards(output: BatchOutput) -> list[str]:
    """A placeholder's reward is ``0.0`` (trajectory-level) or ``[0.0]`` (token-level)."""
    rewards = _column(output, "rewards")
    shapes = (PLACEHOLDER.rewards(token_level=False), PLACEHOLDER.rewards(token_level=True))
    expected = " or ".join(map(str, shapes))
    return [
        f"sample {index}: rewards of a placeholder is {show(rewards[index])}, expected {expected}"
        for index in _placeholder_rows(output)
        if index < len(rewards) and not any(_equals(rewards[index], shape) for shape in shapes)
    ]


def check_placeholder_stop_reasons(output: BatchOutput) -> list[str]:
    """A placeholder stops with ``"rollout_error"``."""
    reasons = _column(output, "stop_reasons")
    return [
        f"sample {index}: stop_reasons of a placeholder is {show(reasons[index])}, "
        f"expected {PLACEHOLDER.stop_reason!r}"
        for index in _placeholder_rows(output)
        if index < len(reasons) and not _equals(reasons[index], PLACEHOLDER.stop_reason)
    ]


def check_placeholder_logprobs(output: BatchOutput) -> list[str]:
    """A placeholder's logprobs are ``[0.0]`` when the batch has logprobs."""
    logprobs, expected = _column(output, "rollout_logprobs"), PLACEHOLDER.logprobs()
    return [
        f"sample {index}: rollout_logprobs of a placeholder is {show(logprobs[index])}, expected {expected}"
        for index in _placeholder_rows(output)
        if index < len(logprobs) and not _equals(logprobs[index], expected)
    ]


def check_rollout_errors_are_placeholders(output: BatchOutput) -> list[str]:
    """Only a placeholder stops with ``"rollout_error"``."""
    flags = _column(output, "is_placeholder")
    return [
        f"sample {index}: stop_reasons is {ROLLOUT_ERROR_STOP_REASON!r} but is_placeholder is "
        f"{show(flags[index])}; only a placeholder may stop with {ROLLOUT_ERROR_STOP_REASON!r}"
        for index, reason in enumerate(_column(output, "stop_reasons"))
        if _equals(reason, ROLLOUT_ERROR_STOP_REASON) and index < len(flags) and flags[index] is not True
    ]


# Step-wise checks.


def check_is_last_step_present(output: BatchOutput) -> list[str]:
    """A step-wise batch has an ``is_last_step`` column."""
    if getattr(output, "is_last_step", None) is None:
        return ["batch: is_last_step is None; a step-wise batch needs it"]
    return []


def check_is_last_step_types(output: BatchOutput) -> list[str]:
    """``is_last_step`` holds real bools, not ints."""
    return [
        f"sample {index}: is_last_step is {show(flag)}, expected a bool"
        for index, flag in enumerate(_column(output, "is_last_step"))
        if not isinstance(flag, bool)
    ]


def check_last_row_ends_trajectory(output: BatchOutput) -> list[str]:
    """The last row of a step-wise batch ends its trajectory."""
    flags = _column(output, "is_last_step")
    if flags and flags[-1] is False:
        return [f"sample {len(flags) - 1}: is_last_step is False but the last row must end its trajectory"]
    return []


def check_step_trajectory_ids_present(output: BatchOutput) -> list[str]:
    """Every row of a step-wise batch has a trajectory id: rows are grouped by it."""
    return [
        f"sample {index}: trajectory_ids is None; a step-wise batch needs a trajectory id on every row"
        for index, tid in enumerate(_column(output, "trajectory_ids"))
        if tid is None
    ]


def check_steps_contiguous(output: BatchOutput) -> list[str]:
    """The steps of one trajectory are contiguous: an id never reappears after a different one."""
    problems = []
    first_row: dict[TrajectoryId, int] = {}
    previous: Any = None
    for index, tid in enumerate(_column(output, "trajectory_ids")):
        if isinstance(tid, TrajectoryId) and _is_well_formed(tid) and tid != previous:  # else reported
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
    flags = _column(output, "is_last_step")
    ids = _column(output, "trajectory_ids")
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
    flags = _column(output, "is_last_step")
    ids = _column(output, "trajectory_ids")
    problems = []
    for index in _placeholder_rows(output):
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
    flags, size = getattr(output, "is_placeholder", None), _batch_size(output)
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
