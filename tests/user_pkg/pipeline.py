"""The user's own rollout pipeline: it builds every env with the env factory it is handed, contains each
rollout's failure itself, and returns a ``BatchOutput`` whose ``is_placeholder`` column marks the rows
that stand for failed rollouts (with no failure record: the batch itself is the only truth)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from gym_resilience import BatchOutput, Task, Trajectory, TrajectoryId, build_batch_output
from gym_resilience.engines import Engine, Sampling

TURNS = 2


def _prompt_ids(engine: Engine, messages: list[dict[str, str]]) -> list[int]:
    ids: Any = engine.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


async def _rollout(task: Task, env_factory: Callable[[Task], Any], engine: Engine) -> Trajectory:
    env = env_factory(task)
    try:
        messages, _ = env.reset(options={"task": task})
        prompt_ids = _prompt_ids(engine, messages)
        response: list[int] = []
        mask: list[int] = []
        reward = 0.0
        stop = "stop"
        for _ in range(TURNS):
            generation = await engine.generate(prompt_ids + response, Sampling(max_tokens=8))
            response += generation.token_ids
            mask += [1] * len(generation.token_ids)
            stop = generation.finish_reason
            text = engine.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
            _, step_reward, terminated, truncated, _ = await asyncio.to_thread(env.step, text)
            reward += float(step_reward)
            if terminated or truncated:
                break
        return Trajectory(
            prompt_ids, response, reward, mask, stop, trajectory_id=TrajectoryId(task.instance_id)
        )
    finally:
        env.close()


async def run(tasks: list[Task], env_factory: Callable[[Task], Any], engine: Engine) -> BatchOutput:
    """The pipeline a scenario names: ``pipeline: <package>.pipeline:run``."""
    outcomes = await asyncio.gather(
        *(_rollout(task, env_factory, engine) for task in tasks), return_exceptions=True
    )
    trajectories = [
        outcome
        if isinstance(outcome, Trajectory)
        else Trajectory(
            [0], [0], 0.0, [0], "error", trajectory_id=TrajectoryId(task.instance_id), is_placeholder=True
        )
        for task, outcome in zip(tasks, outcomes, strict=True)
    ]
    return build_batch_output(trajectories)
