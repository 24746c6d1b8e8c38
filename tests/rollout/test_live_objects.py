"""What a rollout keeps alive while it waits for its generation: every object the garbage collector
tracks is scanned by each young collection, and a batch's rollouts all wait at once, so a few objects
more a rollout add collections to every batch (docs/performance.md, "A rollout keeps little alive")."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from gym_resilience import BatchRunner, RunnerConfig, Task
from gym_resilience.engines.base import Generation, Sampling
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.testing import ScriptableEnv

ROLLOUTS = 64
MOST_PER_ROLLOUT = 56
"""Tracked objects a waiting rollout may keep alive here (51; 82 before closures, the reset's outcome and
unused lists stopped being kept through the wait)."""


class GatedEngine:
    """Holds every request until the batch's last arrives, then counts what the process tracks."""

    def __init__(self) -> None:
        self.tokenizer = ScriptedEngine().tokenizer
        self.gate: asyncio.Event | None = None
        self.waiting = 0
        self.tracked_while_waiting = 0

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        assert self.gate is not None
        self.waiting += 1
        if self.waiting == ROLLOUTS:
            gc.collect()
            self.tracked_while_waiting = len(gc.get_objects())
            self.gate.set()
        await self.gate.wait()
        return Generation(token_ids=[5, 6, 7], logprobs=None, finish_reason="length")


def make_env(task: Task) -> ScriptableEnv:
    return ScriptableEnv()


async def test_a_rollout_waiting_for_its_generation_keeps_few_objects_alive() -> None:
    engine = GatedEngine()
    runner = BatchRunner(engine, make_env, RunnerConfig(max_turns=1))
    tasks = [
        Task(prompt=[{"role": "user", "content": f"task {i}"}], instance_id=f"t{i}") for i in range(ROLLOUTS)
    ]

    async def batch() -> Any:
        engine.gate, engine.waiting = asyncio.Event(), 0
        return await runner.generate(tasks)

    for _ in range(2):  # caches and pool threads settle first
        await batch()
    gc.collect()
    before = len(gc.get_objects())
    result = await batch()
    assert not result.failures and len(result.trajectories) == ROLLOUTS
    per_rollout = (engine.tracked_while_waiting - before) / ROLLOUTS
    assert 0 < per_rollout <= MOST_PER_ROLLOUT, per_rollout
