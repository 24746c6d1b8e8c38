"""Each rollout of a run as the reports draw it: its calls (from the span log), whether a placeholder
stands in for it, and why it failed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from gym_resilience import AnyTrajectory, BatchOutput, StepWiseTrajectory
from harness.faults.plan import FaultFiring
from harness.faults.spans import Span, SpanLog
from harness.judge.probes import attempt_nodes
from harness.judge.results import Attempt, RolloutSpan, TurnSpan
from harness.run.outcome import RunOutcome

__all__ = ["attempt_records", "build_rollout_spans", "rollout_records"]


def _none_first(value: int | None) -> int:
    return -1 if value is None else value


def build_rollout_spans(
    span_log: SpanLog | Sequence[Span], n_rollouts: int, *, until_s: float | None = None
) -> list[RolloutSpan]:
    """One ``RolloutSpan`` per rollout index ``0 .. n_rollouts - 1``, its calls by attempt, then start.

    ``span_log`` is the log, or the spans already read from it (``SpanLog.read()``).

    Calls outside any known rollout (an engine call in a user's pipeline) are left out. A call that
    never ended (a hang, whose worker a deadline killed) counts as failed and ends where its rollout's
    next call starts (a retry), else at ``until_s``, else at the last moment anything was logged: the
    kill itself is not logged, so this is an upper bound. ``placeholder`` and ``error`` are left for
    the caller, who knows the batch's failures.
    """
    spans = span_log.read() if isinstance(span_log, SpanLog) else list(span_log)
    last = max((s.end_s if s.end_s is not None else s.start_s for s in spans), default=0.0)
    open_end = until_s if until_s is not None else last
    by_rollout: list[list[Span]] = [[] for _ in range(n_rollouts)]
    for span in spans:
        if span.rollout is not None and 0 <= span.rollout < n_rollouts:
            by_rollout[span.rollout].append(span)
    rollouts = []
    for index, calls in enumerate(by_rollout):
        calls.sort(key=lambda s: (_none_first(s.attempt), s.start_s))
        turn_spans = []
        for position, span in enumerate(calls):
            end_s = span.end_s
            if end_s is None:
                later = [s.start_s for s in calls[position + 1 :] if s.start_s >= span.start_s]
                end_s = min(later) if later else max(open_end, span.start_s)
            turn_spans.append(
                TurnSpan(
                    kind=span.kind,
                    turn=span.turn,
                    attempt=span.attempt or 0,
                    start_s=span.start_s,
                    end_s=end_s,
                    failed=span.failed or span.end_s is None,
                )
            )
        rollouts.append(RolloutSpan(index=index, spans=turn_spans))
    return rollouts


def rollout_records(
    outcome: RunOutcome, n_rollouts: int, index_of: Mapping[str, int], samples: int
) -> list[RolloutSpan]:
    """Each rollout of a run: its calls (from the span log, each with the Ray node its attempt's env ran
    on, from the runner's attempt records), whether a placeholder stands in for it (the batch's
    ``is_placeholder`` column, whoever built the batch) and why it failed (the trajectory's failure, else
    the fault that broke its last call).

    A row's rollout is ``task index x samples + repetition`` by its trajectory id, or its position in
    the batch when it has none (``samples``: rollouts per task; 1 for a user pipeline).
    """
    rollouts = build_rollout_spans(outcome.spans, n_rollouts, until_s=outcome.end_s)
    nodes = attempt_nodes(outcome.attempts)
    if nodes:  # each call carries the node of its attempt's env
        for record in rollouts:
            where = [nodes.get((record.index, span.attempt)) for span in record.spans]
            record.spans = [dataclasses.replace(s, node=n) for s, n in zip(record.spans, where, strict=True)]
    output = outcome.output
    if output is not None:
        for row, index in enumerate(_row_rollouts(output, index_of, samples)):
            if 0 <= index < n_rollouts and output.is_placeholder[row]:
                rollouts[index].placeholder = True
    failures = _failures(outcome.trajectories or [], index_of, samples)
    for record in rollouts:
        error = failures.get(record.index)
        if error is None and (record.placeholder or outcome.error is not None):
            error = _injected_failure(outcome.firings, record.index)
        record.error = error
    return rollouts


def attempt_records(outcome: RunOutcome) -> list[Attempt]:
    """Every attempt of every rollout of a run, as the runner recorded it (``BatchResult.attempts``),
    failed ones included, with the node its env ran on."""
    return [
        Attempt(
            rollout=record.rollout_index,
            attempt=record.attempt,
            node=record.node_id,
            phase=record.phase,
            elapsed_s=record.elapsed_s,
            error=record.error,
        )
        for record in outcome.attempts
    ]


def _rollout_of(trajectory_id: Any, fallback: int, index_of: Mapping[str, int], samples: int) -> int:
    instance_id = getattr(trajectory_id, "instance_id", None)
    repetition = getattr(trajectory_id, "repetition", 0)
    if (
        isinstance(instance_id, str)
        and instance_id in index_of
        and isinstance(repetition, int)
        and 0 <= repetition < samples
    ):
        return index_of[instance_id] * samples + repetition
    return fallback


def _row_rollouts(output: BatchOutput, index_of: Mapping[str, int], samples: int) -> list[int]:
    """The rollout of each row of ``output`` (a step-wise rollout's rows end at ``is_last_step``)."""
    rollouts = []
    position = 0
    for row in range(len(output)):
        trajectory_id = output.trajectory_ids[row] if row < len(output.trajectory_ids) else None
        rollouts.append(_rollout_of(trajectory_id, position, index_of, samples))
        last = output.is_last_step[row] if output.is_last_step is not None else True
        position += 1 if last else 0
    return rollouts


def _failures(
    trajectories: Sequence[AnyTrajectory], index_of: Mapping[str, int], samples: int
) -> dict[int, str]:
    """``Type: message`` (the message ends with the root cause) of each failed rollout's failure record."""
    failures: dict[int, str] = {}
    for position, trajectory in enumerate(trajectories):
        steps = trajectory.steps if isinstance(trajectory, StepWiseTrajectory) else [trajectory]
        failure = next((step.failure for step in steps if step.failure is not None), None)
        if failure is not None:
            rollout = _rollout_of(trajectory.trajectory_id, position, index_of, samples)
            failures[rollout] = f"{failure.error_type}: {failure.message}"
    return failures


def _injected_failure(firings: Sequence[FaultFiring], rollout: int) -> str | None:
    """What the last fault that broke a call of ``rollout`` did (``step raised ConnectionError: ...``)."""
    hits = [f for f in firings if f.rollout == rollout and f.failed_call]
    if not hits:
        return None
    last = max(hits, key=lambda f: (f.attempt or 0, f.at_s))
    return f"{last.detail} (fault {last.fault})"
