"""What an env hands back, checked before the rollout uses it: a wrong type fails where it is made."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from gym_resilience.engines.base import Generation
from gym_resilience.errors import EngineError
from gym_resilience.validation.values import first_bad_number, first_bad_token, show

__all__ = ["check_generation", "checked_step", "numeric_info"]


def check_generation(engine: object, generation: Generation, *, logprobs: bool) -> None:
    """Raise ``EngineError`` for a generation the output validator would reject in its row (a token id
    that is no non-negative int, a finish reason that is no str, and when ``logprobs`` a logprob missing
    or not a finite number <= 0): it fails its own rollout, not the whole batch at validation."""
    name = type(engine).__name__
    ids: Any = generation.token_ids
    if type(ids) is not list:
        raise EngineError(f"{name} returned token_ids of type {type(ids).__name__}, expected a list")
    bad = first_bad_token(ids)
    if bad is not None:
        raise EngineError(f"{name} returned token id {show(ids[bad])}, expected a non-negative int")
    if type(generation.finish_reason) is not str:
        raise EngineError(f"{name} returned finish reason {show(generation.finish_reason)}, expected a str")
    if not logprobs:
        return
    values: Any = generation.logprobs
    if type(values) is not list or len(values) != len(ids):
        count = (
            "no logprobs"
            if values is None
            else f"{len(values)} logprobs"
            if type(values) is list
            else f"logprobs {show(values)}"
        )
        raise EngineError(f"{name} returned {count} for {len(ids)} tokens; logprobs=True needs one per token")
    bad = first_bad_number(values, at_most_zero=True)
    if bad is not None:
        raise EngineError(
            f"{name} returned logprob {show(values[bad])} for token {bad}, expected a finite number <= 0"
        )


def checked_step(result: object) -> tuple[object, float, bool, bool, Mapping[str, Any]]:
    """An env's ``step`` result, or a TypeError that says which part is wrong and what it was."""
    if not isinstance(result, tuple) or len(result) != 5:
        raise TypeError(
            f"env.step must return (observation, reward, terminated, truncated, info), got {result!r:.80}"
        )
    observation, reward, terminated, truncated, info = result
    if (
        type(reward) is float
        and math.isfinite(reward)
        and type(terminated) is bool
        and type(truncated) is bool
        and type(info) is dict
    ):
        return observation, reward, terminated, truncated, info  # the common case, checked at once
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise TypeError(
            f"env.step returned a reward of type {type(reward).__name__} ({reward!r:.40}), expected a number"
        )
    if not math.isfinite(reward):  # it would make the batch's reward metrics and any loss NaN
        raise ValueError(f"env.step returned a reward of {reward!r}, expected a finite number")
    for name, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, bool | numbers.Integral | np.bool_):
            raise TypeError(f"env.step returned {name}={flag!r:.40}, expected a bool")
    if not isinstance(info, Mapping):
        raise TypeError(f"env.step returned info of type {type(info).__name__}, expected a dict")
    return observation, float(reward), bool(terminated), bool(truncated), info


def numeric_info(info: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of a step's ``info``: what becomes a trajectory's ``env_metrics``.

    Numbers (NumPy's too) become floats, and flags (``solved: True``) 1.0 or 0.0, as skyrl-gym's
    ``default_aggregate_metrics`` counts them; anything else (text, lists, None) is left out.
    """
    return {
        key: float(value)
        for key, value in info.items()
        if isinstance(value, numbers.Real | np.bool_)  # NumPy's bool is no Real
    }
