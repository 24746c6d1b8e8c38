"""What containment costs and what it saves, measured side by side in one run.

(a) Scripted engine, 1,000 and 10,000 rollouts: batch time with ``skip_failed_rollouts`` on vs off
    (no failures, so the difference is the containment machinery), and per-rollout time at 10,000 vs
    1,000 (flat cost means the ratio stays near 1).
(b) Real vLLM (the bundled tiny model): tokens/s through ``BatchRunner`` (64 single-turn tasks,
    64 tokens, greedy) vs the same prompt ids fanned straight into the engine with ``asyncio.gather``.
(c) Goodput on real vLLM: 64 three-turn rollouts, 10% failing at their second turn: trajectories kept
    with the flag vs without it (the step aborts: 0 kept).

Rounds interleave the variants and report medians, because these machines are noisy.
Run: python benchmarks/runner_overhead.py [--rounds N] [--skip-vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import gymnasium
from gymnasium import spaces

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gym_resilience import BatchRunner, EnvStepError, RunnerConfig, Task
from gym_resilience.engines.scripted import ScriptedEngine


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


async def timed(run: Callable[[], Awaitable[Any]]) -> float:
    start = time.perf_counter()
    await run()
    return time.perf_counter() - start


async def scripted_overhead(rounds: int) -> None:
    engine = ScriptedEngine()
    samples: dict[tuple[int, bool], list[float]] = {}
    for _ in range(rounds):
        for n in (1_000, 10_000):
            batch = make_tasks(n)
            for flag in (False, True):
                runner = BatchRunner(
                    engine, TinyTextEnv, RunnerConfig(skip_failed_rollouts=flag, max_turns=2)
                )
                elapsed = await timed(functools.partial(runner.generate, batch))
                samples.setdefault((n, flag), []).append(elapsed)
    median = {key: statistics.median(values) for key, values in samples.items()}
    print("(a) scripted engine, 2 turns per rollout, medians of", rounds, "rounds")
    for n in (1_000, 10_000):
        off, on = median[(n, False)], median[(n, True)]
        print(
            f"    {n:>6} rollouts: flag off {off:.3f} s, flag on {on:.3f} s, on/off {on / off:.3f} "
            f"({(on / off - 1) * 100:+.1f}%)"
        )
    per_small, per_large = median[(1_000, True)] / 1_000, median[(10_000, True)] / 10_000
    print(
        f"    per rollout (flag on): {per_small * 1e6:.0f} us at 1,000, {per_large * 1e6:.0f} us at 10,000, "
        f"ratio 10k/1k {per_large / per_small:.3f}"
    )


async def vllm_throughput_and_goodput(rounds: int) -> None:
    from gym_resilience.agent_loop import ChatCodec
    from gym_resilience.engines import Sampling
    from gym_resilience.engines.vllm import VLLMEngine
    from gym_resilience.models import build_tiny_model

    async with VLLMEngine(build_tiny_model()) as engine:
        batch = make_tasks(64)
        config = RunnerConfig(max_turns=1, max_tokens=64, temperature=0.0)
        runner = BatchRunner(engine, TinyTextEnv, config)
        codec = ChatCodec(engine.tokenizer)
        prompts = [codec.prompt(task.prompt) for task in batch]
        sampling = Sampling(max_tokens=64, temperature=0.0)
        await runner.generate(batch)  # warm-up: compile and cache

        async def through_runner() -> int:
            result = await runner.generate(batch)
            return sum(sum(mask) for mask in result.output.loss_masks)

        async def straight() -> int:
            generations = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
            return sum(len(g.token_ids) for g in generations)

        rates: dict[str, list[float]] = {"runner": [], "gather": []}
        for _ in range(rounds):
            for name, run in (("gather", straight), ("runner", through_runner)):
                start = time.perf_counter()
                tokens = await run()
                rates[name].append(tokens / (time.perf_counter() - start))
        runner_rate, gather_rate = statistics.median(rates["runner"]), statistics.median(rates["gather"])
        print("(b) real vLLM, 64 single-turn tasks x 64 tokens, greedy, medians of", rounds, "rounds")
        print(
            f"    BatchRunner {runner_rate:.0f} tok/s, asyncio.gather {gather_rate:.0f} tok/s, "
            f"ratio {runner_rate / gather_rate:.3f}"
        )

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


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-vllm", action="store_true", help="only part (a)")
    args = parser.parse_args()
    await scripted_overhead(args.rounds)
    if not args.skip_vllm:
        await vllm_throughput_and_goodput(args.rounds)


if __name__ == "__main__":
    asyncio.run(main())
