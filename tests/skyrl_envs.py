"""skyrl-gym envs that fail on demand, registered with skyrl-gym on import.

They live in an importable module (not in a test file) because an isolated env's worker imports its env
class by name, from the parent's ``sys.path``. Each is a real skyrl-gym env (gsm8k_multi_turn); the flaky
one misbehaves where the :class:`doubles.Fault` list in its ``extras`` says (``faults(...)`` writes it),
and counts its closes:

- a ``"step"`` fault fires on the env's 0-based turn, a ``"close"`` fault when it closes; skyrl-gym envs do
  not know their task's instance id, so these faults name no instances;
- ``tag``: ``close`` appends it to ``CLOSED`` (in this process), so a test can count closes.
"""

from __future__ import annotations

from typing import Any

import skyrl_gym
from doubles import Fault
from skyrl_gym.envs.base_text_env import BaseTextEnvStepOutput
from skyrl_gym.envs.gsm8k.multi_turn_env import GSM8kMultiTurnEnv

FLAKY_ID = "flaky_gsm8k_multi_turn"
TUPLE_STEP_ID = "tuple_step_gsm8k"

CLOSED: list[str] = []
"""The ``tag`` of every env of this process whose ``close`` ran, in order."""


def faults(*faults: Fault) -> dict[str, Any]:
    """The extras that make a flaky env misbehave where ``faults`` say."""
    return {"faults": faults}


class FlakyMultiTurnEnv(GSM8kMultiTurnEnv):
    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        extras = extras or {}
        super().__init__(env_config, extras)
        self.faults: tuple[Fault, ...] = tuple(extras.get("faults", ()))
        self.tag = extras.get("tag")

    def _faults(self, phase: str) -> None:
        for fault in self.faults:
            fault.fire(phase, "", self.turns, 0)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self._faults("step")
        return super().step(action)

    def close(self) -> None:
        if self.tag is not None:
            CLOSED.append(self.tag)
        self._faults("close")


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
