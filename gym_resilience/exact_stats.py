"""NumPy's mean, population standard deviation, linear percentile and max of a list of numbers, in plain
Python and to the same bit: the same float64 operations in the same order (NumPy's pairwise summation
included).

A batch's metrics are a few reductions over one number per row, computed once, right after the batch's
generation. The core that runs them sat idle through that generation and finds its caches cold: there
each NumPy call costs 100-500 us (its ufunc and array machinery is large code), ten times what it costs in
a loop, and the handful a batch makes cost a 64-rollout batch about 0.6 ms. These loops cost a fraction of
that, cold or not, and give the numbers SkyRL's generator gets from NumPy.

Values that are not finite, and integers whose sums a float cannot hold exactly, go to NumPy itself (its
rules for those are its own).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import reduce
from operator import add

import numpy as np

__all__ = ["exact_max", "exact_mean", "exact_percentile", "exact_std", "pairwise_sum"]

_BLOCK = 128  # NumPy's pairwise summation: up to this many values, eight running sums; past it, halves


def pairwise_sum(values: Sequence[float]) -> float:
    """``np.add.reduce`` of the values as one contiguous float64 array, in its order of additions (onto
    0.0, as NumPy's: a sum of negative zeros is a positive one)."""
    return 0.0 + _pairwise(values, 0, len(values))


def _pairwise(values: Sequence[float], start: int, count: int) -> float:
    if count < 8:
        return reduce(add, values[start : start + count], 0.0)
    if count <= _BLOCK:
        whole = start + count - count % 8
        lanes = [reduce(add, values[start + lane : whole : 8]) for lane in range(8)]
        total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + (
            (lanes[4] + lanes[5]) + (lanes[6] + lanes[7])
        )
        return reduce(add, values[whole : start + count], total)
    half = count // 2
    half -= half % 8
    return _pairwise(values, start, half) + _pairwise(values, start + half, count - half)


def _floats(values: Sequence[float | int]) -> list[float] | None:
    """The values as floats, or None where NumPy's own rules apply: a value that is not finite (or a
    sum past what a float holds), or integers whose sums a float cannot hold exactly (NumPy sums those
    in chunks of its own)."""
    floats = list(map(float, values))
    magnitude = reduce(add, map(abs, floats), 0.0)
    if not math.isfinite(magnitude):
        return None
    if magnitude >= 2**53 and not all(isinstance(value, float) for value in values):
        return None
    return floats


def exact_mean(values: Sequence[float | int]) -> float:
    """``float(np.mean(values))``; values must not be empty."""
    floats = _floats(values)
    if floats is None:
        return float(np.mean(values))
    return pairwise_sum(floats) / len(floats)


def exact_std(values: Sequence[float | int]) -> float:
    """``float(np.std(values))``: the population standard deviation; values must not be empty."""
    floats = _floats(values)
    if floats is None:
        return float(np.std(values))
    mean = pairwise_sum(floats) / len(floats)
    squares = [(value - mean) * (value - mean) for value in floats]
    return math.sqrt(pairwise_sum(squares) / len(floats))


def exact_percentile(values: Sequence[float | int], q: float) -> float:
    """``float(np.percentile(values, q))`` with NumPy's default (linear) method; values must not be
    empty, ``q`` in [0, 100]."""
    floats = _floats(values)
    if floats is None:
        return float(np.percentile(values, q))
    ordered = sorted(floats)
    count = len(ordered)
    position = (count - 1) * (q / 100)
    if position >= count - 1:  # NumPy takes the last value, at either side, and a weight past it
        low = high = count - 1
        weight = position + 1
    else:
        low = math.floor(position)
        high = low + 1
        weight = position - low
    below, above = ordered[low], ordered[high]
    step = above - below
    if weight >= 0.5:
        return above - step * (1 - weight)
    return below + step * weight


def exact_max(values: Sequence[float | int]) -> float:
    """``float(np.max(values))``; values must not be empty."""
    floats = _floats(values)
    if floats is None:
        return float(np.max(values))
    return max(floats)
