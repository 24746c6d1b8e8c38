"""Where a batch's time goes: each engine request's and env step's span, noted while the batch runs,
and the batch's time split from them (``engine_limit.py``'s time splits)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from gym_resilience.engines import Sampling


class Spans:
    """When each engine request and each env step ran, from the start of a batch (one batch at a time)."""

    def __init__(self) -> None:
        self.start = 0.0
        self.generating: list[tuple[float, float]] = []
        self.stepping: list[tuple[float, float]] = []

    def begin(self) -> None:
        self.start = time.perf_counter()
        self.generating, self.stepping = [], []

    def now(self) -> float:
        return time.perf_counter() - self.start


SPANS = Spans()


class TimedEngine:
    """An engine whose requests are noted in ``SPANS`` (the time split's runs only)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Any:
        began = SPANS.now()
        try:
            return await self.engine.generate(prompt_ids, sampling)
        finally:
            SPANS.generating.append((began, SPANS.now()))


def covered(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``spans``, as disjoint spans in order."""
    union: list[tuple[float, float]] = []
    for begin, end in sorted(spans):
        if union and begin <= union[-1][1]:
            union[-1] = (union[-1][0], max(union[-1][1], end))
        else:
            union.append((begin, end))
    return union


def length(spans: Sequence[tuple[float, float]]) -> float:
    return sum(end - begin for begin, end in spans)


def edges(total: float, spans: Spans) -> tuple[float, float, float, float]:
    """A single-turn batch's time as (total, until its last request went in, from there until its last
    result came back, after that)."""
    last_in = max(begin for begin, _ in spans.generating)
    last_out = max(end for _, end in spans.generating)
    return total, last_in, last_out - last_in, total - last_out


def split(total: float, spans: Spans) -> tuple[float, float, float]:
    """A batch's time as (generating, only env steps, neither): the engine had a request in flight; only
    env steps ran; the rest (the runner's own work, hand-overs between threads)."""
    generating = covered(spans.generating)
    both = covered(spans.generating + spans.stepping)
    return length(generating), length(both) - length(generating), total - length(both)


def print_single_split(splits: dict[str, list[tuple[float, float, float, float]]]) -> None:
    """Where a single-turn batch's time goes, the runner's beside ``gather``'s."""
    count = len(splits["runner"])
    print(f"(a) time split, median of {count} single-turn batches each on the in-process engine (ms)")
    for name, rows in splits.items():
        total, before, engine, after = (statistics.median(column) * 1e3 for column in zip(*rows, strict=True))
        print(
            f"    {name:<7} total {total:5.1f} = until the last request went in {before:4.1f} + until the "
            f"last result came back {engine:5.1f} + after it {after:4.1f}"
        )


def print_split(
    splits: list[tuple[float, float, float, float]],
    offline_generating: list[float],
    turns: int,
    step_s: float,
) -> None:
    """The runner's three-turn batch split beside the limit's, and what passing 1.0 would take."""
    total, generating, env_only, neither = (statistics.median(column) for column in zip(*splits, strict=True))
    offline = statistics.median(offline_generating)
    steps = turns * step_s
    print(
        f"(b) time split, median of {len(splits)} runner batches on the in-process engine (ms): "
        f"total {total * 1e3:.0f} = generating {generating * 1e3:.0f} + only env steps {env_only * 1e3:.0f} "
        f"+ neither {neither * 1e3:.0f}"
    )
    print(
        f"    the limit: {(offline + steps) * 1e3:.0f} = generating {offline * 1e3:.0f} "
        f"(LLM.generate, one batch a turn) + {turns} env steps {steps * 1e3:.0f}"
    )
    # The runner's generation is not the offline engine's (requests join over several engine steps, and
    # the loop's work takes the interpreter from the engine's thread): what is left for everything else.
    room = offline + steps - generating
    print(
        f"    to pass 1.0 with this generation time, only-env-steps + neither must fall under "
        f"{room * 1e3:.0f} ms (now {(env_only + neither) * 1e3:.0f}): a turn-synchronous runner cannot go "
        f"under {steps * 1e3:.0f} ms of steps, so that takes overlapping some rollouts' env steps with the "
        "others' generation (and generating as fast as LLM.generate: at most "
        f"{(offline + step_s) * 1e3:.0f} ms, the last turn's step being the one nothing overlaps, "
        f"{(offline + steps) / (offline + step_s):.2f} of the limit)"
    )
