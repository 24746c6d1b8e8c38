"""What containment costs and what it saves, measured side by side in one run.

(a) Scripted engine, 1,000 and 10,000 rollouts: batch time with ``skip_failed_rollouts`` on vs off
    (no failures, so the difference is the containment machinery), beside two runners with the flag
    off (the same code on both sides: how far apart this machine puts identical runs). Each round runs
    the six (three at each size) 10 times each, rotating their order. Then the cost per rollout at
    each size, on equal work: ten 1,000-rollout batches back to back against one 10,000-rollout batch
    (flag on), 4 pairs a round, paired (flat cost means the ratio stays near 1). Each run starts after
    a full collection and pays for every collection its own rollouts cause, as batches do in training;
    the ratio of single batches is printed beside it, where a 1,000-rollout batch leaves most of its
    share of the full collections to the collection before the next run.
(b) Real vLLM (the bundled tiny model), on ``InProcessVLLMEngine`` (what ``make_vllm_engine`` picks on
    CPU) and on ``VLLMEngine``: tokens/s through ``BatchRunner`` (64 single-turn tasks, 64 tokens,
    greedy) vs the same requests (prompt ids, and each rollout's sampling: ``RunnerConfig.sampling``,
    seeded per rollout) fanned straight into the engine with ``asyncio.gather``, beside a second
    ``gather`` (two identical sides: how far apart this machine puts the same work). Each round
    runs each side ``--pairs`` times (20), in turn. Each batch is also split at its last request and its
    last generations' return (``EngineTimeline``): the runner's own time is its part before and after
    the engine's beyond ``gather``'s, and held beside ``gather``'s batch it gives the ratio with the
    engine's part, where this machine's noise lives, the same on both sides.
(c) Goodput on real vLLM: 64 three-turn rollouts, 10% failing at their second turn: trajectories kept
    with the flag vs without it (the step aborts: 0 kept).

Rounds interleave the variants in pairs (alternating which runs first); a round's ratio is the median of
its pairs' ratios, so a burst of load from elsewhere skews one pair rather than the round, and beside it
the ratio of the round's fastest runs (load from elsewhere only ever adds time). Printed: medians and
ranges over the rounds, and the load average, because these machines are noisy.
Run: python benchmarks/runner_overhead.py [--rounds N] [--pairs N] [--skip-vllm | --only-vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import gymnasium
from gymnasium import spaces

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gym_resilience import BatchRunner, EnvStepError, RunnerConfig, Task
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.rollout import ChatCodec


class TinyTextEnv(gymnasium.Env[list[dict[str, str]], str]):
    """Three turns, constant reward; fails at ``fail_turn`` when asked to."""

    observation_space = spaces.Text(256)  # type: ignore[assignment]
    action_space = spaces.Text(256)

    def __init__(self, task: Task) -> None:
        self.task = task
        self.fail_turn: int | None = task.env_kwargs.get("fail_turn")
        self.turn = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        self.turn = 0
        return list(self.task.prompt), {}

    def step(self, action: str) -> Any:
        if self.turn == self.fail_turn:
            raise ConnectionError("injected network blip")
        self.turn += 1
        return [{"role": "user", "content": "go on"}], 1.0, False, False, {}


def make_tasks(n: int, *, fail_every: int | None = None) -> list[Task]:
    return [
        Task(
            prompt=[{"role": "user", "content": f"task {i}: say something"}],
            instance_id=f"task-{i}",
            env_kwargs={"fail_turn": 1} if fail_every and i % fail_every == 0 else {},
        )
        for i in range(n)
    ]


SCRIPTED_RUNS = 10  # runs of each side per round and batch size in (a)
GROWTH_PAIRS = 4  # pairs a round of ten 1,000-rollout batches against one of 10,000 in (a)

Run = Callable[[], Awaitable[Any]]
M = TypeVar("M")


async def timed(run: Run) -> float:
    gc.collect()  # the previous run's garbage is not this run's cost
    start = time.perf_counter()
    await run()
    return time.perf_counter() - start


def spread(values: list[float], digits: int = 3) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


async def interleaved(runs: list[Run], repeats: int, measure: Callable[[Run], Awaitable[M]]) -> list[list[M]]:
    """``measure`` (``timed``: seconds) of each of ``repeats`` runs of each of ``runs``, one of each in
    turn, rotating which goes first, so that all see the same machine (and none always pays another's
    garbage)."""
    times: list[list[M]] = [[] for _ in runs]
    for repeat in range(repeats):
        shift = repeat % len(runs)
        for index in [*range(shift, len(runs)), *range(shift)]:
            times[index].append(await measure(runs[index]))
    return times


def paired(top: list[float], bottom: list[float]) -> float:
    """The median of the pairs' ratios: a burst of load from elsewhere skews one pair, not the round."""
    return statistics.median(a / b for a, b in zip(top, bottom, strict=True))


def fastest(top: list[float], bottom: list[float]) -> float:
    """The ratio of the fastest runs: load from elsewhere only ever adds time, so the fastest run of each
    is the closest to its own cost."""
    return min(top) / min(bottom)


async def in_turn(runner: BatchRunner, batches: list[list[Task]]) -> None:
    for batch in batches:
        await runner.generate(batch)


async def scripted_overhead(rounds: int) -> None:
    engine = ScriptedEngine()
    sizes = (1_000, 10_000)
    batches = {n: make_tasks(n) for n in sizes}
    ratios: dict[int, list[float]] = {n: [] for n in sizes}
    best: dict[int, list[float]] = {n: [] for n in sizes}
    control: dict[int, list[float]] = {n: [] for n in sizes}
    single_growth: list[float] = []
    per_rollout: dict[int, list[float]] = {n: [] for n in sizes}
    growth: list[float] = []
    for _ in range(rounds):
        # Per size, a second runner with the flag off: two identical sides show how far apart this
        # machine puts the same code (with no failures, on and off run the same code too).
        runs: list[Run] = []
        for n in sizes:
            for flag in (False, True, False):
                config = RunnerConfig(skip_failed_rollouts=flag, max_turns=2)
                runs.append(functools.partial(BatchRunner(engine, TinyTextEnv, config).generate, batches[n]))
        times = iter(await interleaved(runs, SCRIPTED_RUNS, timed))
        single: dict[int, list[float]] = {}
        for n in sizes:
            off_s, on_s, again_s = next(times), next(times), next(times)
            ratios[n].append(paired(on_s, off_s))
            best[n].append(fastest(on_s, off_s))
            control[n].append(paired(again_s, off_s))
            single[n] = [seconds / n for seconds in on_s]
        single_growth.append(paired(single[10_000], single[1_000]))
        # The same 10,000 rollouts as ten batches and as one.
        runner = BatchRunner(engine, TinyTextEnv, RunnerConfig(skip_failed_rollouts=True, max_turns=2))
        tasks = batches[10_000]
        tens = [tasks[i : i + 1_000] for i in range(0, len(tasks), 1_000)]
        ten_s, one_s = await interleaved(
            [functools.partial(in_turn, runner, tens), functools.partial(in_turn, runner, [tasks])],
            GROWTH_PAIRS,
            timed,
        )
        per_rollout[1_000].append(statistics.median(ten_s) / len(tasks))
        per_rollout[10_000].append(statistics.median(one_s) / len(tasks))
        growth.append(paired(one_s, ten_s))
    print(f"(a) scripted engine, 2 turns per rollout, {rounds} rounds: median [range]; load {load()}")
    for n in sizes:
        print(
            f"    {n:>6} rollouts: flag on/off per round {spread(ratios[n])}, fastest runs "
            f"{spread(best[n])}; off/off (the noise) {spread(control[n])}"
        )
    print(
        f"    per rollout (flag on), ten batches of 1,000 vs one of 10,000: "
        f"{statistics.median(per_rollout[1_000]) * 1e6:.0f} vs "
        f"{statistics.median(per_rollout[10_000]) * 1e6:.0f} us; 10k/1k per round {spread(growth)}"
    )
    print(f"    ... single batches, each after a full collection: 10k/1k per round {spread(single_growth)}")


class EngineTimeline:
    """An engine seen from the batch's side: when its last request went in and its last generations came
    back. Both the runner and ``gather`` call it, so both pay for it alike.

    Generations that come back together (an engine step finishing many requests) resume their callers
    one after another in one pass of the event loop, each running its own code before the next resumes
    (a rollout decodes its tokens and sends its env step). So a generation's return is timed at the
    first return of its pass: the caller's own code after it is not the engine's part.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.last_in = self.last_out = 0.0
        self._pass_timed = False  # a generation came back in this pass of the event loop, timed

    async def generate(self, prompt_ids: list[int], sampling: Any) -> Any:
        self.last_in = time.perf_counter()
        try:
            return await self.engine.generate(prompt_ids, sampling)
        finally:
            if not self._pass_timed:
                self._pass_timed = True
                self.last_out = time.perf_counter()
                asyncio.get_running_loop().call_soon(self._end_pass)

    def _end_pass(self) -> None:
        self._pass_timed = False


@dataclass(frozen=True)
class BatchTimes:
    """One batch: its wall time, and how it splits around the engine's part (seconds)."""

    wall: float
    head: float  # the call to its last request reaching the engine
    tail: float  # its last generation to the call's return

    @property
    def engine(self) -> float:
        return self.wall - self.head - self.tail


async def timeline_of(engine: EngineTimeline, run: Run) -> BatchTimes:
    gc.collect()
    start = time.perf_counter()
    await run()
    end = time.perf_counter()
    return BatchTimes(end - start, engine.last_in - start, end - engine.last_out)


async def engine_throughput(name: str, engine: Any, rounds: int, pairs: int) -> None:
    """(b) for one engine: the runner against ``gather`` and against a second ``gather`` (the noise)."""
    timeline = EngineTimeline(engine)
    batch = make_tasks(64)
    config = RunnerConfig(max_turns=1, max_tokens=64, temperature=0.0)
    runner = BatchRunner(timeline, TinyTextEnv, config)
    codec = ChatCodec(engine.tokenizer)
    # The runner's own requests: each rollout's prompt ids and sampling (seeded per rollout, as it seeds).
    requests = [(codec.prompt(task.prompt), config.sampling(i)) for i, task in enumerate(batch)]
    tokens: dict[str, int] = {}

    async def through_runner() -> None:
        result = await runner.generate(batch)
        tokens["runner"] = sum(sum(mask) for mask in result.output.loss_masks)

    async def straight() -> None:
        generations = await asyncio.gather(*(timeline.generate(p, s) for p, s in requests))
        tokens["gather"] = sum(len(g.token_ids) for g in generations)

    await through_runner()  # warm-up: compile and cache
    await straight()
    measure = functools.partial(timeline_of, timeline)
    rates: dict[str, list[float]] = {"runner": [], "gather": []}
    figures: dict[str, list[float]] = {"ratio": [], "fastest": [], "noise": [], "own": [], "held": []}
    engine_part: list[float] = []
    for _ in range(rounds):
        ran, gathered, again = await interleaved([through_runner, straight, straight], pairs, measure)
        runner_s, gather_s = [t.wall for t in ran], [t.wall for t in gathered]
        rates["runner"].append(tokens["runner"] / statistics.median(runner_s))
        rates["gather"].append(tokens["gather"] / statistics.median(gather_s))
        # Time ratios inverted: ratios of tokens/s.
        figures["ratio"].append(paired(gather_s, runner_s))
        figures["fastest"].append(fastest(gather_s, runner_s))
        figures["noise"].append(paired(gather_s, [t.wall for t in again]))
        # The runner's own time: what its batch spends before its last request and after its last
        # generation beyond what gather's does. Held beside gather's batch, it gives the ratio with the
        # engine's part, which is where this machine's noise lives, the same on both sides.
        own = [r.head + r.tail - g.head - g.tail for r, g in zip(ran, gathered, strict=True)]
        figures["own"].append(statistics.median(own) * 1e3)
        figures["held"].append(
            statistics.median(g.wall / (g.wall + o) for g, o in zip(gathered, own, strict=True))
        )
        engine_part.append(paired([t.engine for t in gathered], [t.engine for t in ran]))
    print(
        f"    {name}: BatchRunner {spread(rates['runner'], 0)} tok/s, "
        f"gather {spread(rates['gather'], 0)} tok/s"
    )
    print(
        f"      runner/gather per round {spread(figures['ratio'])}, "
        f"fastest runs {spread(figures['fastest'])}; gather/gather (the noise) {spread(figures['noise'])}"
    )
    print(
        f"      the runner's own time {spread(figures['own'], 1)} ms a batch; runner/gather with the "
        f"engine's part held equal {spread(figures['held'])} "
        f"(engine part, gather/runner {spread(engine_part)})"
    )


async def vllm_throughput_and_goodput(rounds: int, pairs: int) -> None:
    from gym_resilience.engines.vllm import VLLMEngine
    from gym_resilience.engines.vllm_inprocess import InProcessVLLMEngine
    from gym_resilience.models import build_tiny_model

    model = build_tiny_model()
    print(
        f"(b) real vLLM, 64 single-turn tasks x 64 tokens, greedy, {rounds} rounds of {pairs} runs "
        f"of each side; load {load()}"
    )
    async with InProcessVLLMEngine(model) as engine:  # make_vllm_engine's pick on CPU
        await engine_throughput("InProcessVLLMEngine", engine, rounds, pairs)
    async with VLLMEngine(model) as engine:
        await engine_throughput("VLLMEngine", engine, rounds, pairs)
        print(f"    load {load()}")
        flaky = make_tasks(64, fail_every=10)
        failing = sum(1 for t in flaky if t.env_kwargs)
        kept: dict[bool, int] = {}
        for flag in (True, False):
            goodput_runner = BatchRunner(
                engine, TinyTextEnv, RunnerConfig(skip_failed_rollouts=flag, max_turns=3, max_tokens=16)
            )
            try:
                result = await goodput_runner.generate(flaky)
                kept[flag] = sum(1 for t in result.trajectories if not t.is_placeholder)
            except EnvStepError:  # without the flag, the first failure aborts the whole step
                kept[flag] = 0
        print(f"(c) goodput, 64 rollouts x 3 turns, {failing} failing at their second turn")
        print(f"    trajectories kept: with skip_failed_rollouts {kept[True]}, without {kept[False]}")


def load() -> str:
    return "/".join(f"{value:.1f}" for value in os.getloadavg())


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=20, help="runs of each side per round in (b)")
    parts = parser.add_mutually_exclusive_group()
    parts.add_argument("--skip-vllm", action="store_true", help="only part (a)")
    parts.add_argument("--only-vllm", action="store_true", help="only parts (b) and (c)")
    args = parser.parse_args()
    if not args.only_vllm:
        await scripted_overhead(args.rounds)
    if not args.skip_vllm:
        await vllm_throughput_and_goodput(args.rounds, args.pairs)


if __name__ == "__main__":
    asyncio.run(main())
