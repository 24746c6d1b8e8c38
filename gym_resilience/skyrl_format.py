"""The installed SkyRL's ``GeneratorOutput``: its keys, its ``TrajectoryID`` and its metric names.

When the ``skyrl`` package imports, a batch is exported in the shape that release reads as its own: only
the keys its ``GeneratorOutput`` declares (text models), its own ``TrajectoryID`` objects, and rollout
metrics under names its ``concatenate_generator_outputs`` aggregates correctly. Without it, nothing here
changes the export.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["SkyRLRelease", "installed_skyrl", "skyrl_metrics"]

VISION_KEYS: Final = ("pixel_values", "image_grid_thw")
"""Keys of a vision model's ``GeneratorOutput``: SkyRL's text generator leaves them out."""

# Per batch, so a sum, mean, min or max over batches would be wrong: they stay in BatchResult.metrics.
_PER_BATCH: Final = ("rollout_error_rate", "reward/mean", "rollouts", "batch_time_s")
_PER_BATCH_PREFIXES: Final = ("e2e_time/",)
# SkyRL's concatenate_generator_outputs averages a metric it does not compute whose name holds "avg" or
# "mean", takes the min of one holding "min", the max of one holding "max", and sums the rest.
_NOT_SUMMED: Final = ("avg", "mean", "min", "max")
# Counters named after an exception class: a class such as TerminatedError would be aggregated as a min.
_NAMED_COUNTERS: Final = ("rollout_errors/type/", "rollout_errors/cause/")
_COMPLETION: Final = "generate/trajectory_time_completion_"
_SPLITS: Final = (
    "generate/trajectory_time_llm_",
    "generate/trajectory_time_env_",
    "generate/trajectory_time_other_",
)


@dataclass(frozen=True, slots=True)
class SkyRLRelease:
    """What the installed SkyRL reads: its ``GeneratorOutput`` keys (text models) and ``TrajectoryID``."""

    keys: tuple[str, ...]
    trajectory_id: type[Any]

    @property
    def has_time_splits(self) -> bool:
        """Whether this release knows ``trajectory_time_splits`` (0.3.0 does not)."""
        return "trajectory_time_splits" in self.keys


@functools.cache
def installed_skyrl() -> SkyRLRelease | None:
    """The installed SkyRL release, or None when ``skyrl.train.generators.base`` does not import."""
    if importlib.util.find_spec("skyrl") is None:
        return None
    try:
        base = importlib.import_module("skyrl.train.generators.base")
    except Exception:  # a broken or partial install (0.3.0's pydantic models on Python 3.11)
        return None
    keys = tuple(key for key in base.GeneratorOutput.__annotations__ if key not in VISION_KEYS)
    return SkyRLRelease(keys=keys, trajectory_id=base.TrajectoryID)


def skyrl_metrics(metrics: Mapping[str, float], release: SkyRLRelease) -> dict[str, float]:
    """``metrics`` under the names ``release`` uses, less those its batch aggregation would get wrong.

    SkyRL's ``concatenate_generator_outputs`` recomputes its own ``generate/*`` metrics and, for any other
    key, averages those naming avg or mean, takes the min or max of those naming min or max, and sums the
    rest. The project's counters (``rollout_errors``, ``rollout_errors/*``, ``retries``, ...) are sums, so
    they stay; a counter named after an exception class whose name holds one of those words
    (``rollout_errors/cause/TerminatedError``) is added to ``rollout_errors/cause/other`` (or
    ``type/other``) instead, which SkyRL sums (``BatchResult.metrics`` keeps the class name); its
    per-batch figures (``rollout_error_rate``, ``e2e_time/*``, ``reward/mean``,
    ``rollouts``, ``batch_time_s``) are left out. Without ``trajectory_time_splits`` in the release, the
    completion times take its names (``generate/trajectory_completion_time_*``) and the splits are left
    out, as it has none.
    """
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if name in _PER_BATCH or name.startswith(_PER_BATCH_PREFIXES):
            continue
        if not release.has_time_splits:
            if name.startswith(_SPLITS):
                continue
            if name.startswith(_COMPLETION):
                name = "generate/trajectory_completion_time_" + name.removeprefix(_COMPLETION)
        prefix = next((p for p in _NAMED_COUNTERS if name.startswith(p)), None)
        if prefix is not None and any(word in name.removeprefix(prefix) for word in _NOT_SUMMED):
            name = prefix + "other"
            value += out.get(name, 0.0)
        out[name] = value
    return out
