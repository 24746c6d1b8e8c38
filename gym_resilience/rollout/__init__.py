"""One rollout of a batch, by concern.

- :mod:`~gym_resilience.rollout.codec`: chat messages to token ids and back (``ChatCodec``).
- :mod:`~gym_resilience.rollout.checks`: an env's step result checked before use.
- :mod:`~gym_resilience.rollout.progress`: where a rollout is (``Progress``), and ``current_rollout()``.
- :mod:`~gym_resilience.rollout.context`: ``RolloutContext``, what one attempt runs with.
- :mod:`~gym_resilience.rollout.pool`: the threads that run env calls (``EnvPool``).
- :mod:`~gym_resilience.rollout.env_calls`: the env built, called and closed in the pool (``LateCloses``).
- :mod:`~gym_resilience.rollout.open_envs`: the envs a batch has open, closed if its rollouts cannot.
- :mod:`~gym_resilience.rollout.start_line`: the first rollouts of a batch send their prompts together.
- :mod:`~gym_resilience.rollout.turn_line`: rollouts whose envs stepped together then generate together.
- :mod:`~gym_resilience.rollout.loop`: the turn loop and the trajectory (``run_agent_loop``).
"""

from gym_resilience.backends.choice import EnvFactory
from gym_resilience.rollout.codec import ChatCodec
from gym_resilience.rollout.context import RolloutContext
from gym_resilience.rollout.env_calls import LateCloses
from gym_resilience.rollout.loop import run_agent_loop
from gym_resilience.rollout.open_envs import OpenEnvs
from gym_resilience.rollout.pool import EnvPool
from gym_resilience.rollout.progress import Progress, current_rollout, rollout_headers
from gym_resilience.rollout.start_line import StartLine
from gym_resilience.rollout.turn_line import TurnLine

__all__ = [
    "ChatCodec",
    "EnvFactory",
    "EnvPool",
    "LateCloses",
    "OpenEnvs",
    "Progress",
    "RolloutContext",
    "StartLine",
    "TurnLine",
    "current_rollout",
    "rollout_headers",
    "run_agent_loop",
]
