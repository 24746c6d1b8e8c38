"""Per-step overhead of ResilientEnv against gymnasium.make's default wrappers, on CartPole-v1.

Three stacks step the same seeded, pre-sampled random actions on one CartPole env: the raw env,
``ResilientEnv(raw)``, and ``OrderEnforcing(PassiveEnvChecker(raw))`` (what ``gymnasium.make`` adds by
default, TimeLimit aside). The stacks run interleaved in rounds, in a rotating order, because the
machine is noisy; reset time at episode ends is measured and left out. Reported: medians over rounds of
the per-step time, and of each stack's per-round overhead over the raw env.

Run: python benchmarks/wrapper_overhead.py [--steps 1000] [--rounds 300]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import gymnasium
import numpy as np
from gymnasium.wrappers import OrderEnforcing, PassiveEnvChecker

from gym_resilience.backends.resilient import ResilientEnv

ENV_ID = "CartPole-v1"
SEED = 0


def stacks() -> dict[str, gymnasium.Env[Any, Any]]:
    """The three stacks, around one raw env: each measurement starts from the same seeded reset."""
    raw = gymnasium.make(ENV_ID, disable_env_checker=True).unwrapped
    return {
        "raw env": raw,
        "ResilientEnv": ResilientEnv(raw),
        "OrderEnforcing+PassiveEnvChecker": OrderEnforcing(PassiveEnvChecker(raw)),
    }


def step_time_ns(env: gymnasium.Env[Any, Any], actions: list[int]) -> float:
    """Nanoseconds per step over ``actions``, resets at episode ends left out."""
    perf_counter_ns = time.perf_counter_ns
    step = env.step
    reset = env.reset
    reset(seed=SEED)
    reset_ns = 0
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = perf_counter_ns()
        for action in actions:
            _, _, terminated, truncated, _ = step(action)
            if terminated or truncated:
                reset_start = perf_counter_ns()
                reset()
                reset_ns += perf_counter_ns() - reset_start
        total_ns = perf_counter_ns() - start
    finally:
        if gc_was_enabled:
            gc.enable()
    return (total_ns - reset_ns) / len(actions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000, help="steps per stack per round")
    parser.add_argument("--rounds", type=int, default=300, help="interleaved rounds")
    args = parser.parse_args()

    rng = np.random.default_rng(SEED)
    actions = [int(action) for action in rng.integers(0, 2, size=args.steps)]
    envs = stacks()
    names = list(envs)
    for env in envs.values():  # warm up: PassiveEnvChecker checks its first reset and step
        step_time_ns(env, actions[:1_000])

    per_step: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            per_step[name].append(step_time_ns(envs[name], actions))
    envs["ResilientEnv"].close()  # closes the one raw env

    raw = "raw env"
    overhead = {
        name: statistics.median(s - r for s, r in zip(per_step[name], per_step[raw], strict=True))
        for name in names
        if name != raw
    }
    width = max(map(len, names))
    print(f"{ENV_ID}: {args.steps} steps x {args.rounds} interleaved rounds, medians, resets excluded")
    for name in names:
        line = f"  {name:<{width}}  {statistics.median(per_step[name]) / 1000:7.3f} us/step"
        if name != raw:
            line += f"   overhead {overhead[name]:+7.1f} ns/step"
        print(line)
    resilient, default = overhead["ResilientEnv"], overhead["OrderEnforcing+PassiveEnvChecker"]
    print(f"  ResilientEnv overhead / default wrappers overhead: {resilient / default:.2f}")
    verdict = "less" if resilient < default else "MORE"
    print(f"  ResilientEnv adds {verdict} per step than gymnasium.make's default wrappers")


if __name__ == "__main__":
    main()
