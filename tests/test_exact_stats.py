"""exact_stats gives NumPy's mean, std, percentile and max to the bit, on any sizes and kinds of values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gym_resilience.exact_stats import exact_max, exact_mean, exact_percentile, exact_std, pairwise_sum

# Around the edges of NumPy's pairwise summation (8 running sums up to 128 values, halves past it) and of
# its 8,192-value buffers.
SIZES = [1, 2, 7, 8, 9, 15, 16, 17, 64, 127, 128, 129, 136, 255, 256, 257, 1000, 8192, 8193, 20000]


def _samples(rng: np.random.Generator, size: int) -> dict[str, list[float] | list[int]]:
    return {
        "token counts": rng.integers(0, 4096, size).tolist(),
        "few values": rng.integers(0, 3, size).tolist(),
        "times": rng.exponential(0.2, size).tolist(),
        "floats of every scale": (rng.uniform(-1, 1, size) * 10.0 ** rng.integers(-8, 8, size)).tolist(),
    }


@pytest.mark.parametrize("size", SIZES)
def test_mean_std_max_and_percentiles_are_numpys_to_the_bit(size: int) -> None:
    rng = np.random.default_rng(size)
    for kind, values in _samples(rng, size).items():
        assert exact_mean(values) == float(np.mean(values)), kind
        assert exact_std(values) == float(np.std(values)), kind
        assert exact_max(values) == float(np.max(values)), kind
        for q in (0, 10, 37.5, 50, 90, 99.9, 100):
            assert exact_percentile(values, q) == float(np.percentile(values, q)), (kind, q)


def test_each_row_of_a_table_is_reduced_as_numpy_reduces_it_along_the_rows() -> None:
    rng = np.random.default_rng(0)
    table = rng.exponential(0.2, (4, 300))
    means, p90s = np.mean(table, axis=1), np.percentile(table, 90, axis=1)
    for row, mean, p90 in zip(table.tolist(), means, p90s, strict=True):
        assert (exact_mean(row), exact_percentile(row, 90)) == (float(mean), float(p90))


def test_a_sum_of_negative_zeros_is_a_positive_zero_as_numpys() -> None:
    for size in (1, 3, 8, 9, 200):
        assert math.copysign(1.0, pairwise_sum([-0.0] * size)) == 1.0
        assert math.copysign(1.0, exact_mean([-0.0] * size)) == math.copysign(
            1.0, float(np.mean([-0.0] * size))
        )


@pytest.mark.parametrize(
    "values",
    [
        [1.0, math.nan, 2.0],
        [1.0, math.inf],
        [-math.inf, 3.0],
        [1e308, 1e308],
        [2**60, 3, -(2**60), 7],
    ],
    ids=["nan", "inf", "-inf", "overflowing sum", "integers past a float's precision"],
)
def test_values_outside_plain_float_arithmetic_get_numpys_own_answer(values: list[float]) -> None:
    def same(ours: float, numpys: float) -> bool:
        return ours == numpys or (math.isnan(ours) and math.isnan(numpys))

    with np.errstate(all="ignore"):
        assert same(exact_mean(values), float(np.mean(values)))
        assert same(exact_std(values), float(np.std(values)))
        assert same(exact_percentile(values, 90), float(np.percentile(values, 90)))
        assert same(exact_max(values), float(np.max(values)))
