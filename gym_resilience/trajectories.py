"""Trajectory types and the columnar ``BatchOutput`` a trainer consumes.

Column names and meanings follow SkyRL's ``GeneratorOutput``: ``BatchOutput.to_dict()`` gives that dict
(every one of its keys, placeholders included) and ``BatchOutput.from_dict()`` takes one back, so a SkyRL
trainer consumes a batch through ``to_dict()``. Trajectories are plain mutable dataclasses: trainers edit
rewards and masks in place, which is why every placeholder is a fresh object.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

from gym_resilience.errors import OutputValidationError, Phase
from gym_resilience.skyrl_format import installed_skyrl, skyrl_metrics

__all__ = [
    "GENERATOR_OUTPUT_KEYS",
    "REQUIRED_KEYS",
    "ROLLOUT_ERROR_STOP_REASON",
    "AnyTrajectory",
    "BatchOutput",
    "RolloutFailure",
    "StepWiseTrajectory",
    "Trajectory",
    "TrajectoryId",
    "build_batch_output",
    "without_timings",
]

ROLLOUT_ERROR_STOP_REASON: Final = "rollout_error"
"""The stop reason of a placeholder trajectory; any reason but ``"stop"`` counts as non-stop."""

GENERATOR_OUTPUT_KEYS: Final = (
    "prompt_token_ids",
    "response_ids",
    "rewards",
    "loss_masks",
    "stop_reasons",
    "rollout_metrics",
    "rollout_logprobs",
    "trajectory_ids",
    "trajectory_generation_times",
    "trajectory_time_splits",
    "rollout_expert_indices",
    "is_last_step",
    "env_metrics",
)
"""The keys of SkyRL's ``GeneratorOutput`` (text models), in its order: what ``BatchOutput.to_dict`` gives."""

REQUIRED_KEYS: Final = ("prompt_token_ids", "response_ids", "rewards", "loss_masks", "stop_reasons")
"""The keys a mapping needs to become a ``BatchOutput``; the others default to None."""


@dataclass(frozen=True, slots=True)
class TrajectoryId:
    """Names one sample: the task's instance id and which repetition of it."""

    instance_id: str
    repetition: int = 0

    def __str__(self) -> str:
        return f"{self.instance_id}_{self.repetition}"

    # SkyRL's TrajectoryID has these two: its trainer and validator read them, so ours pass for it.

    @property
    def repetition_id(self) -> int:
        """``repetition``, under the name SkyRL's ``TrajectoryID`` gives it."""
        return self.repetition

    def to_string(self) -> str:
        """``"<instance_id>_<repetition>"``, as SkyRL's ``TrajectoryID.to_string()``."""
        return str(self)

    @classmethod
    def coerce(cls, value: Any) -> Any:
        """``value`` as a ``TrajectoryId`` when it names one, else ``value`` itself (a validator reports it).

        Takes a ``TrajectoryId``, anything with ``instance_id`` and ``repetition_id`` (SkyRL's
        ``TrajectoryID``), or a string ``"<instance_id>_<repetition>"``.
        """
        if isinstance(value, TrajectoryId):
            return value
        instance_id = getattr(value, "instance_id", None)
        repetition = getattr(value, "repetition_id", None)
        if (
            isinstance(instance_id, str)
            and isinstance(repetition, numbers.Integral)  # NumPy's integers too
            and not isinstance(repetition, bool)
        ):
            return cls(instance_id, int(repetition))
        if isinstance(value, str):
            head, _, tail = value.rpartition("_")
            if head and tail.isascii() and tail.isdigit():
                return cls(head, int(tail))
        return value


@dataclass(frozen=True, slots=True)
class RolloutFailure:
    """What a placeholder stands for: the failure of its rollout.

    ``error_type`` and ``message`` are the failure as raised (``EnvStepError``, whose message ends with
    its root cause); ``root_cause_type`` and ``root_cause_message`` are what actually went wrong (the
    innermost foreign ``__cause__``, e.g. ``ConnectionError``; the failure itself when it has none).
    """

    error_type: str
    message: str
    phase: Phase
    turn: int | None
    root_cause_type: str
    root_cause_message: str


@dataclass(slots=True)
class Trajectory:
    """One rollout (or, step-wise, one turn of it) in token space.

    ``loss_mask`` is 1 for tokens the policy generated and 0 for tokens the env wrote; ``reward`` is a
    float (trajectory-level) or one float per response token (token-level). ``close_error`` is the root
    cause (``"OSError: ..."``) when closing the env failed after the episode was complete: the trajectory
    is kept all the same.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    reward: float | list[float]
    loss_mask: list[int]
    stop_reason: str
    rollout_logprobs: list[float] | None = None
    env_metrics: dict[str, Any] = field(default_factory=dict)
    e2e_time: float | None = None
    time_splits: dict[str, float] | None = None
    trajectory_id: TrajectoryId | None = None
    is_placeholder: bool = False
    failure: RolloutFailure | None = None
    close_error: str | None = None


@dataclass(slots=True)
class StepWiseTrajectory:
    """One rollout as one ``Trajectory`` per turn, for step-wise training.

    ``close_error`` is as in ``Trajectory``.
    """

    steps: list[Trajectory]
    e2e_time: float | None = None
    trajectory_id: TrajectoryId | None = None
    is_placeholder: bool = False
    close_error: str | None = None


AnyTrajectory = Trajectory | StepWiseTrajectory


@dataclass(slots=True)
class BatchOutput:
    """The columnar batch a trainer consumes; one row per sample (step-wise: per step).

    The columns are those of SkyRL's ``GeneratorOutput``, with its meanings, plus ``is_placeholder``
    (rows that stand for a failed rollout; empty means none). ``is_last_step`` is set only for
    step-wise batches. ``trajectory_generation_times`` is each row's rollout ``e2e_time`` (placeholders:
    the measured time until the failure), or None when any row lacks one. ``trajectory_time_splits``
    maps each part of that time (``"llm"``, ``"env"``) to one entry per row, or is None when any row
    lacks its split (a placeholder has none). ``env_metrics`` is each row's ``env_metrics`` dict
    (placeholders: empty). ``rollout_expert_indices`` is always None here: no bundled engine returns
    routed-expert indices.
    """

    prompt_token_ids: list[list[int]]
    response_ids: list[list[int]]
    rewards: list[float | list[float]]
    loss_masks: list[list[int]]
    stop_reasons: list[str]
    rollout_logprobs: list[list[float]] | None
    trajectory_ids: list[TrajectoryId | None]
    is_last_step: list[bool] | None = None
    is_placeholder: list[bool] = field(default_factory=list)
    rollout_metrics: dict[str, float] = field(default_factory=dict)
    trajectory_generation_times: list[float] | None = None
    trajectory_time_splits: dict[str, list[float]] | None = None
    rollout_expert_indices: list[Any] | None = None
    env_metrics: list[dict[str, Any]] | None = None

    def __len__(self) -> int:
        return len(self.response_ids)

    def to_dict(self) -> dict[str, Any]:
        """The batch as SkyRL's ``GeneratorOutput``: exactly ``GENERATOR_OUTPUT_KEYS``, placeholders included.

        Columns and their rows are copies. Where the dict says something its own way:

        - ``trajectory_ids`` are ``TrajectoryId`` objects, which have what SkyRL's ``TrajectoryID`` has
          (``instance_id``, ``repetition_id``, ``to_string()``); they are given in every mode (SkyRL's
          generator gives them only step-wise, and its checks accept them in either), and the column is
          None when a row has no id.
        - there is no ``is_placeholder`` key: a placeholder is a row whose stop reason is
          ``"rollout_error"``, as in SkyRL's generator, and ``from_dict`` reads the flags back from that.

        Where the ``skyrl`` package imports, the dict is what that release reads as its own: exactly the
        keys of its ``GeneratorOutput`` (text models: a key it lacks, such as 0.3.0's missing
        ``trajectory_time_splits``, is left out, and one it adds is None), its own ``TrajectoryID``
        objects, and the metrics ``skyrl_format.skyrl_metrics`` gives.

        Validate the batch first: a malformed batch is exported as it is.
        """
        ids = self.trajectory_ids
        exported = {
            "prompt_token_ids": _copy_rows(self.prompt_token_ids),
            "response_ids": _copy_rows(self.response_ids),
            "rewards": _copy_rows(self.rewards),
            "loss_masks": _copy_rows(self.loss_masks),
            "stop_reasons": list(self.stop_reasons),
            "rollout_metrics": dict(self.rollout_metrics),
            "rollout_logprobs": _copy_rows(self.rollout_logprobs),
            "trajectory_ids": None if ids is None or None in ids else list(ids),
            "trajectory_generation_times": _copy_rows(self.trajectory_generation_times),
            "trajectory_time_splits": None
            if self.trajectory_time_splits is None
            else {name: list(times) for name, times in self.trajectory_time_splits.items()},
            "rollout_expert_indices": _copy_rows(self.rollout_expert_indices),
            "is_last_step": _copy_rows(self.is_last_step),
            "env_metrics": None
            if self.env_metrics is None
            else [dict(row) if isinstance(row, Mapping) else row for row in self.env_metrics],
        }
        release = installed_skyrl()
        if release is None:
            return exported
        if exported["trajectory_ids"] is not None:
            exported["trajectory_ids"] = [
                release.trajectory_id(t.instance_id, t.repetition) for t in ids if t is not None
            ]
        exported["rollout_metrics"] = skyrl_metrics(self.rollout_metrics, release)
        return {key: exported.get(key) for key in release.keys}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BatchOutput:
        """A batch from SkyRL's ``GeneratorOutput`` (or ``to_dict()``'s output); it shares the dict's lists.

        ``is_placeholder`` is read from ``stop_reasons`` (``"rollout_error"`` rows); ``trajectory_ids``
        become ``TrajectoryId`` objects (from SkyRL's ``TrajectoryID`` or ``"<instance_id>_<repetition>"``
        strings), and a None column one None per row, as SkyRL's generator leaves it outside step-wise
        mode. Keys missing among the optional ones are None; unknown keys (a vision model's
        ``pixel_values``) are left out. Nothing else is checked: ``validate_batch_output`` checks the rest.

        Raises:
            TypeError: ``data`` is not a mapping.
            OutputValidationError: a key of ``REQUIRED_KEYS`` is missing.
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"BatchOutput.from_dict expects a mapping, got {type(data).__name__}")
        problems = cls.missing_keys(data)
        if problems:
            raise OutputValidationError(problems)
        return cls.from_mapping_unchecked(data)

    @staticmethod
    def missing_keys(data: Mapping[str, Any]) -> list[str]:
        """One problem per ``REQUIRED_KEYS`` key not in ``data``, worded as ``validate_batch_output``'s."""
        return [
            f"batch: {key} is missing; a GeneratorOutput needs it" for key in REQUIRED_KEYS if key not in data
        ]

    @classmethod
    def from_mapping_unchecked(cls, data: Mapping[str, Any]) -> BatchOutput:
        """``from_dict`` without its checks: whatever the values are, they land in the columns as they are
        (bar the two conversions ``from_dict`` describes), for ``validate_batch_output`` to report."""
        response_ids = data.get("response_ids")
        stop_reasons = data.get("stop_reasons")
        ids = data.get("trajectory_ids")
        if ids is None and isinstance(response_ids, list):
            ids = [None] * len(response_ids)
        elif isinstance(ids, list):
            ids = [TrajectoryId.coerce(tid) for tid in ids]
        metrics = data.get("rollout_metrics")
        return cls(
            prompt_token_ids=data.get("prompt_token_ids"),  # type: ignore[arg-type]
            response_ids=response_ids,  # type: ignore[arg-type]
            rewards=data.get("rewards"),  # type: ignore[arg-type]
            loss_masks=data.get("loss_masks"),  # type: ignore[arg-type]
            stop_reasons=stop_reasons,  # type: ignore[arg-type]
            rollout_logprobs=data.get("rollout_logprobs"),
            trajectory_ids=ids,  # type: ignore[arg-type]
            is_last_step=data.get("is_last_step"),
            is_placeholder=[isinstance(r, str) and r == ROLLOUT_ERROR_STOP_REASON for r in stop_reasons]
            if isinstance(stop_reasons, list)
            else [],
            rollout_metrics=dict(metrics) if isinstance(metrics, Mapping) else {},
            trajectory_generation_times=data.get("trajectory_generation_times"),
            trajectory_time_splits=data.get("trajectory_time_splits"),
            rollout_expert_indices=data.get("rollout_expert_indices"),
            env_metrics=data.get("env_metrics"),
        )


def _copy_rows(rows: list[Any] | None) -> Any:
    """A new column whose list rows are new lists too; None stays None."""
    if rows is None:
        return None
    return [row[:] if isinstance(row, list) else row for row in rows]


def _rows(trajectories: Iterable[AnyTrajectory]) -> Iterable[tuple[Trajectory, bool, float | None]]:
    """Each row's trajectory, whether it ends its rollout, and its rollout's e2e time."""
    for trajectory in trajectories:
        if isinstance(trajectory, StepWiseTrajectory):
            last = len(trajectory.steps) - 1
            for index, step in enumerate(trajectory.steps):
                yield step, index == last, trajectory.e2e_time
        else:
            yield trajectory, True, trajectory.e2e_time


def _split_columns(splits: list[dict[str, float] | None]) -> dict[str, list[float]] | None:
    """One list per part of the time (``"llm"``, ``"env"``), or None when a row lacks its split or the
    rows split differently (SkyRL's rule: a partial column is worse than none)."""
    if not splits or splits[0] is None:
        return None
    names = splits[0].keys()
    if any(split is None or split.keys() != names for split in splits):
        return None
    return {name: [split[name] for split in splits if split is not None] for name in names}


def build_batch_output(
    trajectories: Sequence[AnyTrajectory], *, rollout_metrics: dict[str, float] | None = None
) -> BatchOutput:
    """Lay trajectories out as columns; step-wise trajectories give one row per step.

    Columns are copies of the lists in the trajectories, so editing one side leaves the other alone.
    A batch is step-wise when any trajectory is a ``StepWiseTrajectory``.
    """
    step_wise = any(isinstance(t, StepWiseTrajectory) for t in trajectories)
    rows = list(_rows(trajectories))
    steps = [step for step, _, _ in rows]
    logprobs = [step.rollout_logprobs for step in steps]
    times = [e2e for _, _, e2e in rows]
    return BatchOutput(
        prompt_token_ids=[list(step.prompt_ids) for step in steps],
        response_ids=[list(step.response_ids) for step in steps],
        rewards=[_copy_reward(step.reward) for step in steps],
        loss_masks=[list(step.loss_mask) for step in steps],
        stop_reasons=[step.stop_reason for step in steps],
        rollout_logprobs=None if all(lp is None for lp in logprobs) else [list(lp or []) for lp in logprobs],
        trajectory_ids=[step.trajectory_id for step in steps],
        is_last_step=[last for _, last, _ in rows] if step_wise else None,
        is_placeholder=[step.is_placeholder for step in steps],
        rollout_metrics=dict(rollout_metrics or {}),
        trajectory_generation_times=None if None in times else [float(t or 0.0) for t in times],
        trajectory_time_splits=_split_columns([step.time_splits for step in steps]),
        env_metrics=[dict(step.env_metrics) for step in steps],
    )


def _copy_reward(reward: float | list[float]) -> float | list[float]:
    return list(reward) if isinstance(reward, list) else reward


def without_timings(trajectory: AnyTrajectory) -> AnyTrajectory:
    """A copy with the measured times cleared, to compare what two runs generated token for token."""
    if isinstance(trajectory, StepWiseTrajectory):
        return replace(
            trajectory,
            steps=[replace(s, e2e_time=None, time_splits=None) for s in trajectory.steps],
            e2e_time=None,
        )
    return replace(trajectory, e2e_time=None, time_splits=None)
