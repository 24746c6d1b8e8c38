"""Is every successful trajectory of the faulted run the baseline's? And if not, where does it first differ?

Both runs decode greedily on the same engine, but not in the same batches: the rollouts that fail, the
order requests arrive in and the machine's load change which requests share a forward pass. vLLM's
kernels do not promise results independent of the batch (its batch-invariant mode needs GPU Triton
kernels), and measured on CPU, a float32 model's logprobs move by about 1e-6 from one batch
composition to another (a bfloat16 model's by up to 0.05). So:

- token ids, loss masks, rewards, stop reasons and prompts must be equal;
- logprobs must agree within ``LOGPROB_TOLERANCE``;
- a sampled token may differ where the baseline's choice and the faulted run's were a numerical tie:
  same prompt, same tokens before it, both sampled tokens' logprobs within ``TIE_TOLERANCE`` of each
  other (each was the argmax of its run, so they were within rounding of each other) and neither above
  ``TIE_MAX_LOGPROB``: two tokens nearly tied for the top of one distribution each have a probability
  of at most about 0.5, so a token the model was near-certain of was no tie, whatever the other run
  chose. From there on the two continuations legitimately differ, so the rest of that trajectory is
  not compared; the tie is reported, never hidden.

A tie needs logprobs, which the harness records in both runs; without them any difference counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Final

from gym_resilience import BatchOutput

__all__ = [
    "LOGPROB_TOLERANCE",
    "TIE_MAX_LOGPROB",
    "TIE_TOLERANCE",
    "Comparison",
    "Difference",
    "compare_outputs",
]

LOGPROB_TOLERANCE: Final = 1e-3
TIE_TOLERANCE: Final = 1e-3
TIE_MAX_LOGPROB: Final = math.log(0.5) + TIE_TOLERANCE
"""The highest logprob a token chosen at a tie can have: two tokens tied for the argmax share at most
the whole probability, about 0.5 each."""

_COLUMNS: Final = ("prompt_token_ids", "response_ids", "loss_masks", "rewards", "stop_reasons")


@dataclass(frozen=True, slots=True)
class Difference:
    """Where a faulted row first differs from the baseline's: its rollout, turn and token index."""

    rollout: int
    turn: int | None
    column: str
    index: int | None
    baseline: Any
    faulted: Any

    def describe(self) -> str:
        """``rollout 3, turn 1, token 5 (response_ids): baseline 412, faulted 77``."""
        where = [f"rollout {self.rollout}"]
        if self.turn is not None:
            where.append(f"turn {self.turn}")
        if self.index is not None:
            where.append(f"token {self.index}")
        return f"{', '.join(where)} ({self.column}): baseline {self.baseline!r}, faulted {self.faulted!r}"


@dataclass(frozen=True, slots=True)
class Comparison:
    """The verdict (None when a run produced no batch), the first real difference, and the ties."""

    identical: bool | None
    first_difference: Difference | None = None
    ties: list[Difference] = field(default_factory=list)

    def describe(self) -> str:
        """One line for reports: where the runs first differ, and how many ties were let through."""
        parts = []
        if self.first_difference is not None:
            parts.append(f"first difference at {self.first_difference.describe()}")
        if self.ties:
            parts.append(f"{len(self.ties)} numerical tie(s), first at {self.ties[0].describe()}")
        return "; ".join(parts)


@dataclass(frozen=True, slots=True)
class _Row:
    index: int
    rollout: int
    step: int


def _rows(output: BatchOutput) -> dict[tuple[str, int], _Row]:
    """Each row keyed by (trajectory id, step within it); rows without an id are keyed by position."""
    rows: dict[tuple[str, int], _Row] = {}
    rollout, step = 0, 0
    for index in range(len(output)):
        trajectory_id = output.trajectory_ids[index] if index < len(output.trajectory_ids) else None
        key = (str(trajectory_id) if trajectory_id is not None else f"row {index}", step)
        rows[key] = _Row(index, rollout, step)
        last = output.is_last_step[index] if output.is_last_step is not None else True
        rollout, step = (rollout + 1, 0) if last else (rollout, step + 1)
    return rows


def _turn_of(loss_mask: list[int], position: int, step: int, step_wise: bool) -> int:
    """The turn a response position belongs to: its step, or the generated segments up to it."""
    if step_wise:
        return step
    starts = [
        i
        for i in range(min(position + 1, len(loss_mask)))
        if loss_mask[i] == 1 and (i == 0 or loss_mask[i - 1] == 0)
    ]
    segments = len(starts)
    return max(segments - 1, 0)


def _first_index(a: Any, b: Any) -> int | None:
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return i
        return min(len(a), len(b)) if len(a) != len(b) else None
    return None if a == b else -1


def _logprob_index(a: list[float], b: list[float]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if not (math.isfinite(x) and math.isfinite(y)) or abs(x - y) > LOGPROB_TOLERANCE:
            return i
    return None


def _is_tie(baseline: float, faulted: float) -> bool:
    """Whether two different sampled tokens' logprobs are a numerical tie: within rounding of each other,
    and both low enough that another token could have been as likely."""
    return abs(baseline - faulted) <= TIE_TOLERANCE and max(baseline, faulted) <= TIE_MAX_LOGPROB


def compare_outputs(baseline: BatchOutput | None, faulted: BatchOutput | None) -> Comparison:
    """Compare every successful (non-placeholder) row of ``faulted`` with the baseline's row."""
    if baseline is None or faulted is None:
        return Comparison(identical=None)
    step_wise = faulted.is_last_step is not None
    base_rows = _rows(baseline)
    ties: list[Difference] = []
    tied: set[str] = set()
    for key, row in _rows(faulted).items():
        if faulted.is_placeholder[row.index] or key[0] in tied:
            continue
        base = base_rows.get(key)
        if base is None:
            return Comparison(
                False, Difference(row.rollout, row.step, "row", None, "absent", "present"), ties
            )
        difference, tie = _compare_row(baseline, base, faulted, row, step_wise)
        if tie is not None:
            ties.append(tie)
            tied.add(key[0])
        elif difference is not None:
            return Comparison(False, difference, ties)
    return Comparison(True, None, ties)


def _compare_row(
    baseline: BatchOutput, base: _Row, faulted: BatchOutput, row: _Row, step_wise: bool
) -> tuple[Difference | None, Difference | None]:
    """(the first real difference, None) or (None, a tie) or (None, None) when the rows agree."""
    mask = faulted.loss_masks[row.index]

    def at(column: str, index: int | None, a: Any, b: Any) -> Difference:
        turn = _turn_of(mask, index, row.step, step_wise) if index is not None and index >= 0 else None
        return Difference(row.rollout, turn, column, index if index is None or index >= 0 else None, a, b)

    responses = baseline.response_ids[base.index], faulted.response_ids[row.index]
    token = _first_index(*responses)
    base_lps = baseline.rollout_logprobs[base.index] if baseline.rollout_logprobs is not None else None
    lps = faulted.rollout_logprobs[row.index] if faulted.rollout_logprobs is not None else None
    if token is not None and token >= 0 and base_lps is not None and lps is not None:
        same_start = baseline.prompt_token_ids[base.index] == faulted.prompt_token_ids[row.index] and all(
            getattr(baseline, c)[base.index][:token] == getattr(faulted, c)[row.index][:token]
            for c in ("response_ids", "loss_masks")
        )
        both_sampled = token < min(len(base_lps), len(lps), len(mask)) and mask[token] == 1
        tied = _is_tie(base_lps[token], lps[token]) if both_sampled else False
        if same_start and tied and _logprob_index(base_lps[:token], lps[:token]) is None:
            return None, at("response_ids", token, responses[0][token], responses[1][token])
    for column in _COLUMNS:
        a, b = getattr(baseline, column)[base.index], getattr(faulted, column)[row.index]
        index = _first_index(a, b)
        if index is not None:
            shown = (a[index], b[index]) if index >= 0 and index < min(len(a), len(b)) else (a, b)
            return at(column, index if column != "prompt_token_ids" else None, *shown), None
    if (base_lps is None) != (lps is None):
        return at("rollout_logprobs", None, base_lps is not None, lps is not None), None
    if base_lps is not None and lps is not None:
        index = _logprob_index(base_lps, lps)
        if index is not None:
            return at("rollout_logprobs", index, base_lps[index], lps[index]), None
    return None, None
