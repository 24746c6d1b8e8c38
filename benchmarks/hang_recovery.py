"""How long a batch waits for an env that hangs forever, measured side by side in one run.

A 32-rollout batch on real vLLM (the bundled tiny model), every env isolated in its own process
(``isolate_envs=True``) with a step deadline. In the faulted batch one env hangs forever in its first
step; the fault-free batch is the same with no hang. Rounds alternate the two and report medians.
Goal: faulted wall time under deadline + 110% of the fault-free time (the hang costs at most the
deadline, and the rest of the batch goes on meanwhile).

Run: python benchmarks/hang_recovery.py [--rounds N] [--deadline S]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from doubles import EnvCounts, Fault, factory, hang_on, tasks

from gym_resilience import BatchRunner, RunnerConfig

BATCHES: dict[str, tuple[Fault, ...]] = {"fault-free": (), "one env hangs": (hang_on({"t7"}),)}
"""Each batch's faults: in one, the env of the eighth task hangs in its first step."""


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--deadline", type=float, default=3.0)
    args = parser.parse_args()

    from gym_resilience.engines.vllm import VLLMEngine
    from gym_resilience.models import build_tiny_model

    config = RunnerConfig(
        skip_failed_rollouts=True,
        max_turns=2,
        max_tokens=16,
        isolate_envs=True,
        env_step_timeout_s=args.deadline,
    )
    times: dict[str, list[float]] = {name: [] for name in BATCHES}
    placeholders: dict[str, Any] = {}
    async with VLLMEngine(build_tiny_model()) as engine:
        runners = {name: BatchRunner(engine, factory(EnvCounts(), *f), config) for name, f in BATCHES.items()}
        await runners["fault-free"].generate(tasks(32))  # warm-up: compile, start the fork server
        for _ in range(args.rounds):
            for name, runner in runners.items():
                start = time.perf_counter()
                result = await runner.generate(tasks(32))
                times[name].append(time.perf_counter() - start)
                placeholders[name] = sum(t.is_placeholder for t in result.trajectories)
    clean, hung = statistics.median(times["fault-free"]), statistics.median(times["one env hangs"])
    budget = args.deadline + 1.1 * clean
    print(
        f"32 rollouts x 2 turns on real vLLM, isolated envs, step deadline {args.deadline:g} s, "
        f"medians of {args.rounds}"
    )
    print(f"  fault-free     {clean:6.2f} s  ({placeholders['fault-free']} placeholders)")
    print(f"  one env hangs  {hung:6.2f} s  ({placeholders['one env hangs']} placeholder)")
    print(
        f"  hang cost {hung - clean:+.2f} s; goal: under deadline + 110% of fault-free = {budget:.2f} s "
        f"-> {'met' if hung < budget else 'missed'} (ratio to budget {hung / budget:.3f})"
    )


if __name__ == "__main__":
    asyncio.run(main())
