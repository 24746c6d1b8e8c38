"""Behaviours for ScriptableEnv that misbehave inside an isolated env's worker process.

They live in an importable module (not in a test file) because the worker unpickles them by reference: a
spawned or forkserver worker imports this module by name, from the parent's ``sys.path``.
"""

from __future__ import annotations

import functools
import os
import subprocess
import threading
import time
from typing import Any

from gym_resilience.testing import ScriptableEnv


def hang(*_args: Any) -> Any:
    """Never returns (in practice): a stuck tool call, a deadlocked simulator."""
    time.sleep(10**6)


def exit_3(*_args: Any) -> Any:
    """Ends the worker process at once, as a crash in native code would."""
    os._exit(3)


def raise_value_error(env: ScriptableEnv, action: Any) -> Any:
    raise ValueError(f"bad move {action!r}")


def raise_os_error_on_close(env: ScriptableEnv) -> None:
    raise OSError("socket already gone")


class SandboxError(Exception):
    """An exception that holds a lock, so it cannot be pickled."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def raise_unpicklable(env: ScriptableEnv, action: Any) -> Any:
    raise SandboxError("container 3f2a is gone")


class ToolError(Exception):
    """Pickles, but cannot be unpickled: ``__init__`` takes other arguments than ``args``."""

    def __init__(self, tool: str, code: int) -> None:
        super().__init__(f"{tool} exited with {code}")


def raise_tool_error(env: ScriptableEnv, action: Any) -> Any:
    raise ToolError("pytest", 2)


def return_unpicklable(env: ScriptableEnv, action: Any) -> Any:
    return threading.Lock(), 0.0, False, False, {}


def raise_keyboard_interrupt(env: ScriptableEnv, action: Any) -> Any:
    raise KeyboardInterrupt


def spawn_then_hang(env: ScriptableEnv, action: Any) -> Any:
    """Turn 0 starts a subprocess (a tool the env runs) and returns its pid; turn 1 hangs."""
    if env.turn == 0:
        tool = subprocess.Popen(["sleep", "1000"])
        return tool.pid, 0.0, False, False, {}
    return hang()


def broken_factory() -> ScriptableEnv:
    raise RuntimeError("no container runtime")


def print_on_close(env: ScriptableEnv) -> None:
    print("inner close ran", flush=True)


text_env = ScriptableEnv
hanging_step_env = functools.partial(ScriptableEnv, step=hang)
hanging_reset_env = functools.partial(ScriptableEnv, reset=hang)
hanging_close_env = functools.partial(ScriptableEnv, close=hang)
exiting_step_env = functools.partial(ScriptableEnv, step=exit_3)
failing_step_env = functools.partial(ScriptableEnv, step=raise_value_error)
failing_close_env = functools.partial(ScriptableEnv, close=raise_os_error_on_close)


def hang_for_one_task(task: Any) -> ScriptableEnv:
    """A batch runner env factory: the env of the task marked ``{"hang": True}`` hangs in its first step."""
    return ScriptableEnv(step=hang) if task.env_kwargs.get("hang") else ScriptableEnv()
