"""Each rollout of a run as the reports draw it: its calls (from the run's recording), whether a
placeholder stands in for it, and why it failed, all keyed by the rollout index the runner gave it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from harness.faults.events import FaultFiring, Span
from harness.judge.probes import attempt_nodes
from harness.judge.results import Attempt, RolloutSpan, TurnSpan
from harness.run.outcome import RunOutcome

__all__ = ["attempt_records", "build_rollout_spans", "rollout_records"]


def _none_first(value: int | None) -> int:
    return -1 if value is None else value


def build_rollout_spans(
    spans: Sequence[Span], n_rollouts: int, *, until_s: float | None = None
) -> list[RolloutSpan]:
    """One ``RolloutSpan`` per rollout index ``0 .. n_rollouts - 1``, its calls by attempt, then start.

    Calls outside any known rollout (an engine call in a user's pipeline) are left out. A call that
    never ended (a hang, whose worker a deadline killed) counts as failed and ends where its rollout's
    next call starts (a retry), else at ``until_s``, else at the last moment anything was logged: the
    kill itself is not logged, so this is an upper bound. ``placeholder`` and ``error`` are left for
    the caller, who knows the batch's failures.
    """
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


def rollout_records(outcome: RunOutcome, n_rollouts: int) -> list[RolloutSpan]:
    """Each rollout of a run: its calls (from the recording, each with the Ray node its attempt's env ran
    on, from the runner's attempt records), whether a placeholder stands in for it and why it failed
    (the run's ``RolloutEnds``: its failure record, else the fault that broke its last call)."""
    rollouts = build_rollout_spans(outcome.recording.spans, n_rollouts, until_s=outcome.end_s)
    nodes = attempt_nodes(outcome.attempts)
    if nodes:  # each call carries the node of its attempt's env
        for record in rollouts:
            where = [nodes.get((record.index, span.attempt)) for span in record.spans]
            record.spans = [dataclasses.replace(s, node=n) for s, n in zip(record.spans, where, strict=True)]
    for record in rollouts:
        record.placeholder = record.index in outcome.ends.placeholders
        error = outcome.ends.failures.get(record.index)
        if error is None and (record.placeholder or outcome.error is not None):
            error = _injected_failure(outcome.recording.firings_of(record.index))
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


def _injected_failure(firings: Sequence[FaultFiring]) -> str | None:
    """What the last fault that broke a call of a rollout did (``step raised ConnectionError: ...``),
    of that rollout's ``firings``."""
    hits = [f for f in firings if f.failed_call]
    if not hits:
        return None
    last = max(hits, key=lambda f: (f.attempt or 0, f.at_s))
    return f"{last.detail} (fault {last.fault})"
