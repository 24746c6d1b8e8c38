"""Batch metrics, and the log records that report a batch's failures.

Three sets of metrics go into ``rollout_metrics``:

- ``batch_metrics``, the project's own, from the rollouts before substitution: errors by type, root
  cause and phase, completion times (failed rollouts included, with their time until the failure),
  retries, ``env_close_errors``, and ``reward/mean`` over the successful rollouts only;
- ``generate_metrics``, SkyRL's ``generate/*`` names computed as SkyRL's generator computes them: over
  every row, placeholders included (a placeholder's one pad token counts in ``generate/min_num_tokens``),
  before ``zero_reward_on_non_stop`` and ``apply_overlong_filtering``;
- ``reward_metrics``, the reward metrics SkyRL's trainer computes from the batch it receives:
  ``reward/avg_raw_reward`` and ``reward/mean_positive_reward`` over every row, placeholders included
  (their reward is 0.0), after post-processing.

Failures are logged through the ``gym_resilience.runner`` logger: one WARNING per contained failure
(a failed rollout, a failed attempt that is retried, an env whose close failed after a complete
episode) and one WARNING per batch that had any. No handler is installed, so in a program that
configures no logging the WARNING records still reach Python's last-resort handler (stderr).
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import tenacity

from gym_resilience.errors import describe_exception, root_cause
from gym_resilience.exact_stats import exact_max, exact_mean, exact_percentile, exact_std
from gym_resilience.placeholders import FailedRollout
from gym_resilience.trajectories import AnyTrajectory, BatchOutput, StepWiseTrajectory, TrajectoryId

__all__ = [
    "LOGGER_NAME",
    "batch_metrics",
    "generate_metrics",
    "log_batch_summary",
    "log_close_failure",
    "log_failed_rollout",
    "log_retry",
    "reward_metrics",
]

LOGGER_NAME = "gym_resilience.runner"
logger = logging.getLogger(LOGGER_NAME)


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
    failed ones included (their measured time until failure). ``env_close_errors`` counts the
    successful rollouts whose env failed to close (they are kept). ``reward/mean`` is over the
    successful rollouts only; ``reward_metrics`` gives SkyRL's every-row means.
    ``attempts`` maps a rollout's index to its attempts, for the rollouts that were retried.
    """
    failures = [o for o in outputs if isinstance(o, FailedRollout)]
    successes = [o for o in outputs if not isinstance(o, FailedRollout)]
    total = len(outputs)
    metrics: dict[str, float] = {
        "rollouts": float(total),
        "rollout_errors": float(len(failures)),
        "rollout_error_rate": len(failures) / total if total else 0.0,
        "env_close_errors": float(sum(1 for o in successes if o.close_error is not None)),
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


# SkyRL's metrics. They are NumPy's numbers, as SkyRL computes them (population standard deviation,
# linearly interpolated percentiles), to the bit: exact_stats does NumPy's float operations in its order,
# without its cost on the batch's tail. The same batch gives the same numbers on both sides.


def _row_rewards(output: BatchOutput) -> list[float]:
    """One reward per row: a token-level reward is summed."""
    return [float(sum(r)) if isinstance(r, list) else float(r) for r in output.rewards]


def _turn_token_counts(loss_masks: Sequence[Sequence[int]]) -> list[int]:
    """The length of every run of consecutive nonzero entries in the loss masks: the tokens of each
    generated turn (a row's runs split at its zeros, as bytes: 64 rows in 30 rather than 250 us)."""
    return [len(run) for mask in loss_masks for run in _as_bytes(mask).split(b"\0") if run]


def _as_bytes(mask: Sequence[int]) -> bytes:
    """A loss mask as one byte per entry, zero where the entry is."""
    if isinstance(mask, list):
        try:
            return bytes(mask)
        except (ValueError, TypeError):  # an entry that is no byte: the slow way
            pass
    return bytes(1 if bit != 0 else 0 for bit in mask)  # any entry but zero counts, as in SkyRL


def _add_time_stats(metrics: dict[str, float], columns: Mapping[str, Sequence[float]]) -> None:
    """Mean, 90th percentile and max of each column of per-rollout times."""
    for name, times in columns.items():
        if times:
            metrics[f"generate/trajectory_time_{name}_mean"] = exact_mean(times)
            metrics[f"generate/trajectory_time_{name}_p90"] = exact_percentile(times, 90)
            metrics[f"generate/trajectory_time_{name}_max"] = exact_max(times)


def _per_rollout(output: BatchOutput, column: list[Any]) -> list[Any]:
    """A per-row column with one entry per rollout: step-wise, the entry of each rollout's last step."""
    if output.is_last_step is None:
        return column
    return [value for value, last in zip(column, output.is_last_step, strict=False) if last]


def _time_in_no_part(completion: Sequence[float], parts: list[list[float]]) -> list[float]:
    """Each rollout's completion time less each of its parts' in turn, as SkyRL's generator subtracts
    them (``other = other - part`` for each part, in order: to the bit, not the sum of the parts)."""
    rest = [float(value) for value in completion]
    for part in parts:
        rest = [value - float(spent) for value, spent in zip(rest, part, strict=True)]
    return rest


def generate_metrics(output: BatchOutput) -> dict[str, float]:
    """SkyRL's ``generate/*`` metrics of a batch, over every row, placeholders included.

    Call it before post-processing, as SkyRL's generator does. Token counts are per row (step-wise: per
    step); completion times and their splits are per rollout. The ``environment/*`` metrics SkyRL adds
    per env class are not computed: a batch has no env classes.
    """
    if not output.response_ids:
        return {}
    tokens = [len(response) for response in output.response_ids]
    rewards = _row_rewards(output)
    rewarded = [count for count, reward in zip(tokens, rewards, strict=True) if reward > 0.0]
    unrewarded = [count for count, reward in zip(tokens, rewards, strict=True) if reward == 0.0]
    assistant: list[Any] = [sum(mask) for mask in output.loss_masks]
    metrics = {
        "generate/min_num_tokens": float(min(tokens)),
        "generate/max_num_tokens": float(max(tokens)),
        "generate/avg_num_tokens": exact_mean(tokens),
        "generate/std_num_tokens": exact_std(tokens),
        "generate/avg_tokens_non_zero_rewards": exact_mean(rewarded) if rewarded else 0.0,
        "generate/avg_tokens_zero_rewards": exact_mean(unrewarded) if unrewarded else 0.0,
        "generate/avg_assistant_tokens": exact_mean(assistant),
        "generate/min_assistant_tokens": float(min(assistant)),
        "generate/max_assistant_tokens": float(max(assistant)),
        "generate/std_assistant_tokens": exact_std(assistant),
    }
    turns = _turn_token_counts(output.loss_masks)
    if turns:
        metrics["generate/tokens_per_turn_mean"] = exact_mean(turns)
        metrics["generate/tokens_per_turn_std"] = exact_std(turns)
        metrics["generate/tokens_per_turn_max"] = float(max(turns))
    times = output.trajectory_generation_times
    columns: dict[str, list[float]] = {} if times is None else {"completion": _per_rollout(output, times)}
    splits = {
        name: _per_rollout(output, column) for name, column in (output.trajectory_time_splits or {}).items()
    }
    if columns.get("completion") and splits:
        # Time in no named part: tokenizing, templating, waiting for a thread.
        splits["other"] = _time_in_no_part(columns["completion"], list(splits.values()))
    _add_time_stats(metrics, columns | splits)
    return metrics


def reward_metrics(output: BatchOutput) -> dict[str, float]:
    """The reward means SkyRL's trainer logs, over every row (placeholders count with their 0.0).

    Call it after post-processing: SkyRL's trainer computes them from the batch it receives. Step-wise,
    they are over each rollout's last step, as SkyRL's trainer takes them.
    """
    rewards = _per_rollout(output, list(output.rewards))
    if not rewards:
        return {}
    positive = [
        float(sum(max(value, 0.0) for value in reward))
        if isinstance(reward, list)
        else max(float(reward), 0.0)
        for reward in rewards
    ]
    summed = [float(sum(r)) if isinstance(r, list) else float(r) for r in rewards]
    return {
        "reward/avg_raw_reward": exact_mean(summed),
        "reward/mean_positive_reward": exact_mean(positive),
    }


# Log records.


def _turn(turn: int | None) -> str:
    return "" if turn is None else f" at turn {turn}"


def log_failed_rollout(failure: FailedRollout) -> None:
    """One WARNING for a rollout that failed and that a placeholder will stand in for."""
    described = failure.describe()
    attempts = "" if failure.attempts == 1 else f" after {failure.attempts} attempts"
    logger.warning(
        "rollout %d (%s) failed in %s%s%s with %s, root cause %s: %s; a placeholder stands in for it",
        failure.rollout_index,
        failure.trajectory_id,
        failure.phase,
        _turn(failure.turn),
        attempts,
        described.error_type,
        described.root_cause_type,
        described.root_cause_message,
        extra={
            "rollout_index": failure.rollout_index,
            "trajectory_id": str(failure.trajectory_id),
            "rollout_failure": described,
        },
    )


def log_retry(rollout_index: int, trajectory_id: TrajectoryId, state: tenacity.RetryCallState) -> None:
    """One WARNING for a failed attempt of a rollout that is about to be retried."""
    error = state.outcome.exception() if state.outcome is not None else None
    if error is None:
        return
    logger.warning(
        "rollout %d (%s) attempt %d failed with %s, root cause %s; retrying",
        rollout_index,
        trajectory_id,
        state.attempt_number,
        type(error).__name__,
        describe_exception(root_cause(error)),
        extra={"rollout_index": rollout_index, "trajectory_id": str(trajectory_id)},
    )


def log_close_failure(rollout_index: int, trajectory_id: TrajectoryId, error: BaseException) -> None:
    """One WARNING for an env whose close failed after its episode was complete (the trajectory is kept)."""
    logger.warning(
        "rollout %d (%s): closing its env failed after the episode was complete, so the trajectory is "
        "kept; root cause %s",
        rollout_index,
        trajectory_id,
        describe_exception(root_cause(error)),
        extra={"rollout_index": rollout_index, "trajectory_id": str(trajectory_id)},
    )


def log_batch_summary(metrics: Mapping[str, float]) -> None:
    """One WARNING for a batch that had failed rollouts or env close failures; nothing otherwise."""
    failed, closes = int(metrics.get("rollout_errors", 0)), int(metrics.get("env_close_errors", 0))
    parts = []
    if failed:
        prefix = "rollout_errors/cause/"
        causes = ", ".join(
            f"{name.removeprefix(prefix)} x{int(count)}"
            for name, count in sorted(metrics.items())
            if name.startswith(prefix)
        )
        parts.append(
            f"{failed} of {int(metrics.get('rollouts', 0))} rollouts failed and placeholders stand in for "
            f"them (root causes: {causes})"
        )
    if closes:
        parts.append(f"{closes} envs failed to close after a complete episode (their trajectories are kept)")
    if parts:
        logger.warning("batch: %s", "; ".join(parts), extra={"rollout_metrics": dict(metrics)})
