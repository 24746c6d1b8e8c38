"""Bundled text envs for trying the library end to end, registered with Gymnasium on import.

``gym_resilience/WordGame-v0``: a word-guessing game scored every turn (no network).
``gym_resilience/ToolUse-v0``: a calculator task whose every step is an HTTP call to a ``ToolServer``.

Both take ``reset(seed=..., options={"task": task})``, return chat messages as observations and take
the agent's reply (a ``str``) as the action.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

import gymnasium

from gym_resilience.envs.word_game import ChatMessages, WordGameEnv

if TYPE_CHECKING:
    from gym_resilience.envs.tool_env import ToolUseEnv, extract_expression
    from gym_resilience.envs.tool_server import ToolServer, ToolServerProcess

__all__ = [
    "TOOL_USE_ID",
    "WORD_GAME_ID",
    "ChatMessages",
    "ToolServer",
    "ToolServerProcess",
    "ToolUseEnv",
    "WordGameEnv",
    "extract_expression",
    "register_envs",
]

WORD_GAME_ID: Final = "gym_resilience/WordGame-v0"
TOOL_USE_ID: Final = "gym_resilience/ToolUse-v0"


def register_envs() -> None:
    """Register both envs unless already registered: Gymnasium warns when an id is registered twice."""
    entry_points = {
        WORD_GAME_ID: "gym_resilience.envs.word_game:WordGameEnv",
        TOOL_USE_ID: "gym_resilience.envs.tool_env:ToolUseEnv",
    }
    for env_id, entry_point in entry_points.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=entry_point)


register_envs()

# Imported on first use: `python -m gym_resilience.envs.tool_server` imports this package first, and
# an eager import of tool_server here would load it twice (runpy warns about exactly that).
_LAZY: Final = {
    "ToolServer": "gym_resilience.envs.tool_server",
    "ToolServerProcess": "gym_resilience.envs.tool_server",
    "ToolUseEnv": "gym_resilience.envs.tool_env",
    "extract_expression": "gym_resilience.envs.tool_env",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
