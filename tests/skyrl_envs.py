"""skyrl-gym envs that fail on demand, registered with skyrl-gym on import.

They live in an importable module (not in a test file) because an isolated env's worker imports its env
class by name, from the parent's ``sys.path``. Each is a real skyrl-gym env (gsm8k_multi_turn) that fails
where its ``extras`` say:

- ``fail_at_turn``: ``step`` raises ``ConnectionError`` on that 0-based turn;
- ``fail_on_close``: ``close`` raises ``OSError``;
- ``tag``: ``close`` appends it to ``CLOSED`` (in this process), so a test can count closes.
"""

from __future__ import annotations

from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnvStepOutput
from skyrl_gym.envs.gsm8k.multi_turn_env import GSM8kMultiTurnEnv

FLAKY_ID = "flaky_gsm8k_multi_turn"
TUPLE_STEP_ID = "tuple_step_gsm8k"

CLOSED: list[str] = []
"""The ``tag`` of every env of this process whose ``close`` ran, in order."""


class FlakyMultiTurnEnv(GSM8kMultiTurnEnv):
    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        extras = extras or {}
        super().__init__(env_config, extras)
        self.fail_at_turn = extras.get("fail_at_turn")
        self.fail_on_close = bool(extras.get("fail_on_close"))
        self.tag = extras.get("tag")

    def step(self, action: str) -> BaseTextEnvStepOutput:
        if self.turns == self.fail_at_turn:
            raise ConnectionError(f"sandbox connection dropped at turn {self.turns}")
        return super().step(action)

    def close(self) -> None:
        if self.tag is not None:
            CLOSED.append(self.tag)
        if self.fail_on_close:
            raise OSError("sandbox teardown failed")


class TupleStepEnv(GSM8kMultiTurnEnv):
    """Returns Gymnasium's 5-tuple from ``step``, which is not skyrl-gym's protocol."""

    def step(self, action: str) -> Any:
        return [], 0.0, True, False, {}


for env_id, entry_point in (
    (FLAKY_ID, "skyrl_envs:FlakyMultiTurnEnv"),
    (TUPLE_STEP_ID, "skyrl_envs:TupleStepEnv"),
):
    if env_id not in skyrl_gym.registry:
        skyrl_gym.register(id=env_id, entry_point=entry_point)
