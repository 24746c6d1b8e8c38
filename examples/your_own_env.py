"""Run BatchRunner on your own text env: a repeat-after-me game, one rollout of which loses its connection.

The env asks for one word per turn and pays 1/len(words) for each reply that contains it. The task of
``repeat-3`` makes the env raise ``ConnectionError`` at turn 1; with ``skip_failed_rollouts`` that
rollout becomes a placeholder and the batch completes with the other three.

Run: python examples/your_own_env.py          (a scripted engine: no vLLM needed, about a second)
     python examples/your_own_env.py vllm     (real vLLM on the bundled tiny model; its replies are nonsense)
"""

from __future__ import annotations

import asyncio
import re
import sys
from typing import Any

import gymnasium

from gym_resilience import BatchResult, BatchRunner, RunnerConfig, Task, Trajectory, validate_batch_output
from gym_resilience.engines import Engine, Generation, Sampling
from gym_resilience.engines.scripted import CharTokenizer, ScriptedEngine
from gym_resilience.envs import ChatMessages
from gym_resilience.envs.word_game import reply_space
from gym_resilience.tasks import ChatMessage


class RepeatAfterMe(gymnasium.Env[list[ChatMessage], str]):
    """Each turn names a word; a reply that contains it earns 1/len(words). Ends after the last word."""

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 - gymnasium's own annotation

    def __init__(self, words: list[str], fail_at_turn: int | None = None) -> None:
        self.observation_space = ChatMessages()
        self.action_space = reply_space()
        self.words = words
        self.fail_at_turn = fail_at_turn
        self.turn = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[ChatMessage], dict[str, Any]]:
        super().reset(seed=seed)
        task: Task | None = (options or {}).get("task")  # None when reset outside the runner
        self.turn = 0
        prompt = task.prompt if task is not None else []
        return [*prompt, {"role": "user", "content": f"Say {self.words[0]}."}], {}

    def step(self, action: str) -> tuple[list[ChatMessage], float, bool, bool, dict[str, Any]]:
        if self.turn == self.fail_at_turn:
            raise ConnectionError("the word server closed the connection")
        hit = self.words[self.turn] in action.lower()
        reward = 1.0 / len(self.words) if hit else 0.0
        self.turn += 1
        terminated = self.turn == len(self.words)
        text = "Done." if terminated else f"Say {self.words[self.turn]}."
        info = {"hits": int(hit)}
        return [{"role": "user", "content": text}], reward, terminated, False, info

    def close(self) -> None:
        pass  # release sockets, subprocesses, containers here


def env_factory(task: Task) -> gymnasium.Env[list[ChatMessage], str]:
    """Builds the env of one rollout from the task's ``env_kwargs``."""
    return RepeatAfterMe(**task.env_kwargs)


def make_tasks() -> list[Task]:
    system: ChatMessage = {"role": "system", "content": "Repeat the word you are asked for."}
    words = [["red", "green"], ["sun", "moon"], ["cat", "dog"], ["one", "two"]]
    tasks = []
    for index, pair in enumerate(words):
        kwargs: dict[str, Any] = {"words": pair, "fail_at_turn": 1 if index == 3 else None}
        tasks.append(Task(prompt=[system], instance_id=f"repeat-{index}", env_kwargs=kwargs))
    return tasks


def repeat_the_word(prompt_ids: list[int], sampling: Sampling, call_index: int) -> Generation:
    """A scripted policy: reply with the last word the env asked for, then end the turn."""
    tokenizer = CharTokenizer()
    asked = re.findall(r"Say (\w+)\.", tokenizer.decode(prompt_ids))
    token_ids = [*tokenizer.encode(asked[-1]), 3][: sampling.max_tokens]  # 3 is <|im_end|>, the eos
    logprobs = [0.0] * len(token_ids) if sampling.logprobs else None
    return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason="stop")


async def run(engine: Engine) -> BatchResult:
    tasks = make_tasks()
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=4, max_tokens=16)
    result = await BatchRunner(engine, env_factory, config).generate(tasks)
    validate_batch_output(result.output, num_prompts=len(tasks))
    return result


def report(result: BatchResult) -> None:
    for trajectory in result.trajectories:
        assert isinstance(trajectory, Trajectory)  # step_wise=False: one Trajectory per rollout
        failure = f"  placeholder: {trajectory.failure.message}" if trajectory.failure else ""
        print(f"{trajectory.trajectory_id}  reward {trajectory.reward}{failure}")
    for name, value in sorted(result.metrics.items()):
        if name.startswith("rollout_errors"):
            print(f"{name} = {value:g}")


async def main(engine_name: str) -> None:
    if engine_name == "vllm":
        from gym_resilience.engines.vllm import VLLMEngine
        from gym_resilience.models import build_tiny_model

        async with VLLMEngine(build_tiny_model()) as engine:
            result = await run(engine)
    else:
        result = await run(ScriptedEngine(script=repeat_the_word))
    report(result)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "scripted"))
