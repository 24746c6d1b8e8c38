"""The user's task loader: a fixed list of tasks, as a project might read them from its own dataset."""

from __future__ import annotations

from gym_resilience import Task

WORDS = ("apple", "river", "stone", "cloud", "ember", "maple")


def load_tasks() -> list[Task]:
    """The task loader a scenario names: ``batch.tasks: <package>.data:load_tasks``."""
    return [
        Task(
            prompt=[
                {"role": "system", "content": "Guess the hidden word."},
                {"role": "user", "content": f"Puzzle {index}: a word of {len(word)} letters."},
            ],
            instance_id=f"guess-{index}",
            env_kwargs={"word": word, "turns": 2},
        )
        for index, word in enumerate(WORDS)
    ]
