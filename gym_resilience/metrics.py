"""Batch metrics: rollout errors by type, root cause and phase; completion times; rewards (DESIGN.md §3)."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence

from gym_resilience.errors import root_cause
from gym_resilience.placeholders import FailedRollout
from gym_resilience.trajectories import AnyTrajectory, StepWiseTrajectory

__all__ = ["batch_metrics"]


def _total_reward(output: AnyTrajectory) -> float:
    steps = output.steps if isinstance(output, StepWiseTrajectory) else [output]
    return sum(sum(s.reward) if isinstance(s.reward, list) else s.reward for s in steps)


def batch_metrics(
    outputs: Sequence[AnyTrajectory | FailedRollout],
    *,
    elapsed_s: float,
    attempts: Mapping[int, int] | None = None,
) -> dict[str, float]:
    """Metrics of one batch, before substitution: failures are still markers here.

    Errors are counted by the failure's type (``rollout_errors/type/EnvStepError``), by its root cause
    (``rollout_errors/cause/ConnectionError``) and by phase. Completion times cover every rollout,
    failed ones included (their measured time until failure).
    ``attempts`` maps a rollout's index to its attempts, for the rollouts that were retried.
    """
    failures = [o for o in outputs if isinstance(o, FailedRollout)]
    successes = [o for o in outputs if not isinstance(o, FailedRollout)]
    total = len(outputs)
    metrics: dict[str, float] = {
        "rollouts": float(total),
        "rollout_errors": float(len(failures)),
        "rollout_error_rate": len(failures) / total if total else 0.0,
        "batch_time_s": elapsed_s,
    }
    for name, count in Counter(type(f.exception).__name__ for f in failures).items():
        metrics[f"rollout_errors/type/{name}"] = float(count)
    for name, count in Counter(type(root_cause(f.exception)).__name__ for f in failures).items():
        metrics[f"rollout_errors/cause/{name}"] = float(count)
    for phase, count in Counter(f.phase for f in failures).items():
        metrics[f"rollout_errors/phase/{phase}"] = float(count)
    times = [f.elapsed_s for f in failures] + [o.e2e_time for o in successes if o.e2e_time is not None]
    if times:
        metrics["e2e_time/mean"] = statistics.fmean(times)
        metrics["e2e_time/min"] = min(times)
        metrics["e2e_time/max"] = max(times)
        metrics["e2e_time/median"] = statistics.median(times)
    retried = {index: count for index, count in (attempts or {}).items() if count > 1}
    if retried:
        failed_indices = {f.rollout_index for f in failures}
        metrics["retries"] = float(sum(count - 1 for count in retried.values()))
        metrics["retries/rollouts"] = float(len(retried))
        metrics["retries/succeeded"] = float(sum(1 for i in retried if i not in failed_indices))
        metrics["retries/exhausted"] = float(sum(1 for i in retried if i in failed_indices))
    if successes:
        rewards = [_total_reward(o) for o in successes]
        metrics["reward/mean"] = statistics.fmean(rewards)
    return metrics
