"""A user's rollout pipeline in the plain ``asyncio.gather`` style, for scenario 18.

This is how many RL frameworks fan rollouts out before they meet flaky environments: one exception
from any rollout aborts the whole batch, and the env of the rollout that raised is never closed
(``close`` runs on the happy path only). The chaos harness runs it under the same faults as
``BatchRunner`` to show the difference. It uses only the documented pipeline signature:
``async def generate(tasks, env_factory, engine) -> list[Trajectory]``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gym_resilience import Task, Trajectory, TrajectoryId
from gym_resilience.engines import Engine, Sampling

MAX_TURNS = 2


def _chat_ids(engine: Engine, messages: list[dict[str, str]]) -> list[int]:
    ids: Any = engine.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


async def generate(tasks: list[Task], env_factory: Any, engine: Engine) -> list[Trajectory]:
    async def rollout(task: Task) -> Trajectory:
        env = env_factory(task)
        messages, _ = env.reset(seed=0, options={"task": task})
        prompt_ids = _chat_ids(engine, messages)
        response: list[int] = []
        mask: list[int] = []
        reward = 0.0
        generation = None
        for _ in range(MAX_TURNS):
            generation = await engine.generate(prompt_ids + response, Sampling(max_tokens=16))
            response += generation.token_ids
            mask += [1] * len(generation.token_ids)
            text = engine.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
            _, step_reward, terminated, truncated, _ = env.step(text)
            reward += float(step_reward)
            if terminated or truncated:
                break
        env.close()
        return Trajectory(
            prompt_ids=prompt_ids,
            response_ids=response,
            reward=reward,
            loss_mask=mask,
            stop_reason=generation.finish_reason if generation else "stop",
            trajectory_id=TrajectoryId(task.instance_id),
        )

    return list(await asyncio.gather(*(rollout(task) for task in tasks)))
