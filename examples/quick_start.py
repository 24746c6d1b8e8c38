"""Run a batch of multi-turn rollouts on real vLLM where some envs fail, and keep the rest.

The policy is the bundled tiny model (random weights: its text is nonsense, its tokens are real vLLM
generation). Every fourth word-game env drops its connection at the second turn. With
``skip_failed_rollouts`` the batch completes: the failed rollouts become placeholders that the trainer
ignores, every env is closed, and the output passes the bundled validator.

Run: python examples/quick_start.py
"""

from __future__ import annotations

import asyncio
from typing import Any

import gymnasium

from gym_resilience import BatchRunner, RunnerConfig, Task, validate_batch_output
from gym_resilience.engines import VLLMEngine
from gym_resilience.models import build_tiny_model
from gym_resilience.task_gen import generate_tasks, word_game_factory


class DroppedConnection(gymnasium.Wrapper[Any, Any, Any, Any]):
    """Fails the env's second step, as a coding sandbox behind a flaky network might."""

    def __init__(self, env: gymnasium.Env[Any, Any]) -> None:
        super().__init__(env)
        self.steps = 0

    def step(self, action: Any) -> Any:
        self.steps += 1
        if self.steps == 2:
            raise ConnectionError("sandbox connection dropped")
        return self.env.step(action)


def flaky_env(task: Task) -> gymnasium.Env[Any, Any]:
    env = word_game_factory(task)
    return DroppedConnection(env) if int(task.instance_id.rsplit("-", 1)[1]) % 4 == 0 else env


async def main() -> None:
    tasks = generate_tasks(16, seed=0, env="word_game")
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=3, max_tokens=24, logprobs=True)
    async with VLLMEngine(build_tiny_model()) as engine:
        result = await BatchRunner(engine, flaky_env, config).generate(tasks)
    validate_batch_output(result.output, num_prompts=len(tasks))
    kept = sum(not t.is_placeholder for t in result.trajectories)
    print(f"{kept} of {len(tasks)} trajectories kept; the batch passes validate_batch_output")
    for failure in result.failures:
        where = f"{failure.phase} turn {failure.turn}"
        print(f"  placeholder for {failure.trajectory_id}: {where}: {failure.exception}")
    for name in ("rollout_errors", "rollout_error_rate", "reward/mean", "e2e_time/mean", "batch_time_s"):
        print(f"  {name:<20} {result.metrics[name]:.3f}")


if __name__ == "__main__":
    asyncio.run(main())
