"""What running envs in Ray actors costs: per-step overhead and rollouts/s, Ray against processes and threads.

Starts a local Ray cluster (``harness.run.cluster.LocalCluster``) inside a loopback-only network namespace
(``harness.run.netns``; needs root), then measures, side by side in one run:

- per step: ``step`` on CartPole-v1 through ``ResilientEnv`` with the env in this process (``thread``), in
  a worker process (``process``, ``IsolatedEnv``) and in a Ray actor (``ray``, ``RayEnv``);
- per batch: rollouts/s of ``BatchRunner`` (``ScriptedEngine``, a one-turn ``ScriptableEnv``) with each
  ``env_backend``; a new runner per batch, so each batch starts its warm workers (one per rollout in
  flight) and ends them; ``benchmarks/backends.py`` measures runners whose workers are warm already.

Backends alternate within each round, in a rotating order, because the machine is noisy; reported are
medians over rounds, and each backend's ratio to the others taken from the same rounds.

Run: python benchmarks/ray_backend.py [--nodes 1] [--steps 500] [--step-rounds 30] [--rollouts 1000]
[--rollout-rounds 3] [--max-concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import gymnasium

from gym_resilience import BatchRunner, ResilientEnv, RunnerConfig, Task
from gym_resilience.backends.process import IsolatedEnv
from gym_resilience.backends.ray import RayEnv
from gym_resilience.config import ENV_BACKENDS, EnvBackend
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.testing import ScriptableEnv
from harness.run.cluster import LocalCluster
from harness.run.netns import loopback_namespace

ENV_ID = "CartPole-v1"
SEED = 0


def step_envs() -> dict[EnvBackend, ResilientEnv[Any, Any]]:
    make = functools.partial(gymnasium.make, ENV_ID, disable_env_checker=True)
    return {
        "thread": ResilientEnv(make()),
        "process": ResilientEnv(IsolatedEnv(make)),
        "ray": ResilientEnv(RayEnv(make)),
    }


def step_time_us(env: ResilientEnv[Any, Any], steps: int) -> float:
    """Microseconds per step over ``steps`` steps (action 0, then 1, ...); resets left out."""
    env.reset(seed=SEED)
    spent = 0.0
    for index in range(steps):
        start = time.perf_counter()
        _, _, terminated, truncated, _ = env.step(index % 2)
        spent += time.perf_counter() - start
        if terminated or truncated:
            env.reset()
    return spent / steps * 1e6


def one_turn_env(task: Task) -> ScriptableEnv:
    return ScriptableEnv()


def rollouts_per_s(backend: EnvBackend, rollouts: int, max_concurrency: int) -> float:
    config = RunnerConfig(env_backend=backend, max_concurrency=max_concurrency)
    tasks = [
        Task(prompt=[{"role": "user", "content": f"t{i}"}], instance_id=f"t{i}") for i in range(rollouts)
    ]

    async def batch() -> None:
        async with BatchRunner(ScriptedEngine(), one_turn_env, config) as runner:
            await runner.generate(tasks)

    start = time.perf_counter()
    asyncio.run(batch())
    return rollouts / (time.perf_counter() - start)


def rounds(measure: Callable[[EnvBackend], float], count: int) -> dict[EnvBackend, list[float]]:
    """``measure(backend)`` for every backend in each of ``count`` rounds, the order rotating."""
    samples: dict[EnvBackend, list[float]] = {backend: [] for backend in ENV_BACKENDS}
    for index in range(count):
        order = ENV_BACKENDS[index % 3 :] + ENV_BACKENDS[: index % 3]
        for backend in order:
            samples[backend].append(measure(backend))
    return samples


def report(title: str, unit: str, samples: dict[EnvBackend, list[float]]) -> None:
    print(f"{title} (median of {len(samples['ray'])} rounds)")
    for backend, values in samples.items():
        print(f"  {backend:<8} {statistics.median(values):12.1f} {unit}")
    pairs: tuple[tuple[EnvBackend, EnvBackend], ...] = (
        ("ray", "process"),
        ("ray", "thread"),
        ("process", "thread"),
    )
    for a, b in pairs:
        ratios = [x / y for x, y in zip(samples[a], samples[b], strict=True)]
        print(f"  {a}/{b}: {statistics.median(ratios):.3g}x")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the local Ray cluster")
    parser.add_argument("--steps", type=int, default=500, help="steps per backend per round")
    parser.add_argument("--step-rounds", type=int, default=30)
    parser.add_argument("--rollouts", type=int, default=1000, help="rollouts per batch")
    parser.add_argument("--rollout-rounds", type=int, default=3)
    parser.add_argument("--max-concurrency", type=int, default=32, help="rollouts (envs) in flight at once")
    args = parser.parse_args()
    with loopback_namespace(), LocalCluster(args.nodes):
        envs = step_envs()
        try:
            for env in envs.values():  # the first calls warm caches and connections up
                step_time_us(env, 50)
            steps = rounds(lambda backend: step_time_us(envs[backend], args.steps), args.step_rounds)
        finally:
            for env in envs.values():
                env.close()
        report(f"per step, CartPole-v1, {args.steps} steps a round", "us/step", steps)
        batches = rounds(
            lambda backend: rollouts_per_s(backend, args.rollouts, args.max_concurrency), args.rollout_rounds
        )
        report(
            f"BatchRunner, {args.rollouts} one-turn rollouts, {args.max_concurrency} in flight",
            "rollouts/s",
            batches,
        )


if __name__ == "__main__":
    main()
