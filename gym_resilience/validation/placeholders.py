"""The validator's checks of placeholder rows: the shape of a failed rollout's row, and only there."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gym_resilience.placeholders import PLACEHOLDER
from gym_resilience.trajectories import ROLLOUT_ERROR_STOP_REASON, BatchOutput
from gym_resilience.validation.columns import column
from gym_resilience.validation.values import equals, show

__all__ = [
    "check_placeholder_logprobs",
    "check_placeholder_loss_masks",
    "check_placeholder_responses",
    "check_placeholder_rewards",
    "check_placeholder_stop_reasons",
    "check_rollout_errors_are_placeholders",
    "placeholder_rows",
]


def placeholder_rows(output: BatchOutput) -> Iterator[int]:
    """The indexes of the rows flagged placeholders (``is_placeholder`` True)."""
    return (index for index, flag in enumerate(column(output, "is_placeholder")) if flag is True)


def check_placeholder_responses(output: BatchOutput) -> list[str]:
    """A placeholder has exactly ``PLACEHOLDER.response_length`` (one) response token."""
    response_ids = column(output, "response_ids")
    problems = []
    for index in placeholder_rows(output):
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
    expected = PLACEHOLDER.loss_masks()
    return _placeholder_values(output, "loss_masks", (expected,), str(expected))


def check_placeholder_rewards(output: BatchOutput) -> list[str]:
    """A placeholder's reward is ``0.0`` (trajectory-level) or ``[0.0]`` (token-level)."""
    shapes = (PLACEHOLDER.rewards(token_level=False), PLACEHOLDER.rewards(token_level=True))
    return _placeholder_values(output, "rewards", shapes, " or ".join(map(str, shapes)))


def check_placeholder_stop_reasons(output: BatchOutput) -> list[str]:
    """A placeholder stops with ``"rollout_error"``."""
    reason = PLACEHOLDER.stop_reason
    return _placeholder_values(output, "stop_reasons", (reason,), repr(reason))


def check_placeholder_logprobs(output: BatchOutput) -> list[str]:
    """A placeholder's logprobs are ``[0.0]`` when the batch has logprobs."""
    expected = PLACEHOLDER.logprobs()
    return _placeholder_values(output, "rollout_logprobs", (expected,), str(expected))


def _placeholder_values(output: BatchOutput, name: str, allowed: tuple[Any, ...], expected: str) -> list[str]:
    """A problem for each placeholder whose ``name`` entry is none of ``allowed`` (shown: ``expected``)."""
    rows = column(output, name)
    return [
        f"sample {index}: {name} of a placeholder is {show(rows[index])}, expected {expected}"
        for index in placeholder_rows(output)
        if index < len(rows) and not any(equals(rows[index], value) for value in allowed)
    ]


def check_rollout_errors_are_placeholders(output: BatchOutput) -> list[str]:
    """Only a placeholder stops with ``"rollout_error"``."""
    flags = column(output, "is_placeholder")
    return [
        f"sample {index}: stop_reasons is {ROLLOUT_ERROR_STOP_REASON!r} but is_placeholder is "
        f"{show(flags[index])}; only a placeholder may stop with {ROLLOUT_ERROR_STOP_REASON!r}"
        for index, reason in enumerate(column(output, "stop_reasons"))
        if equals(reason, ROLLOUT_ERROR_STOP_REASON) and index < len(flags) and flags[index] is not True
    ]
