"""Envs that report the worker they ran in and what the envs before them left there, for the worker pool's
tests (an importable module: a worker process or a Ray actor imports these by reference).

``LeavingEnv`` steps once and reports, as numbers in ``info`` (so in ``env_metrics``): its worker's pid,
whether ``LEFT_BY_AN_ENV`` is in the environment, and ``MODULE_STATE["steps"]``, the steps that envs of the
same process made before it. Its task's ``env_kwargs["leave"]`` says what it leaves behind at its step:
an environment variable, a process, a thread, a failing close, a hang.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from typing import Any

from gymnasium import spaces

from gym_resilience import Task
from gym_resilience.testing import ScriptableEnv

ENV_VARIABLE = "LEFT_BY_AN_ENV"
MODULE_STATE = {"steps": 0}
"""A module global that envs change: a reused worker keeps it from one env to the next."""


class LeavingEnv(ScriptableEnv):
    def __init__(self, leave: str) -> None:
        super().__init__(observation_space=spaces.Text(32), action_space=spaces.Text(4096))
        self.leave = leave

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        info = {
            "pid": float(os.getpid()),
            "saw_variable": float(ENV_VARIABLE in os.environ),
            "module_steps": float(MODULE_STATE["steps"]),
        }
        MODULE_STATE["steps"] += 1
        if self.leave == "variable":
            os.environ[ENV_VARIABLE] = "1"
        elif self.leave == "process":
            subprocess.Popen(["sleep", "600"])
        elif self.leave == "thread":
            threading.Thread(target=time.sleep, args=(600,), name="left-behind", daemon=True).start()
        elif self.leave == "hang":
            time.sleep(600)
        return "done", 1.0, True, False, info

    def close(self) -> None:
        super().close()
        if self.leave == "failing close":
            raise OSError("the sandbox was gone already")


def leaving_env(task: Task) -> LeavingEnv:
    return LeavingEnv(str(task.env_kwargs.get("leave", "")))


def leaving_tasks(*leaves: str) -> list[Task]:
    """One task per entry: what its env leaves behind ("" for nothing)."""
    return [
        Task(prompt=[{"role": "user", "content": f"t{i}"}], instance_id=f"t{i}", env_kwargs={"leave": leave})
        for i, leave in enumerate(leaves)
    ]
