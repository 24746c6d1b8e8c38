"""Wrap a flaky text env in ResilientEnv: its failure arrives typed, with the cause, and the env is closed.

Run: python examples/wrap_a_flaky_env.py
"""

from __future__ import annotations

from typing import Any, SupportsFloat

from gym_resilience.backends.resilient import ResilientEnv
from gym_resilience.errors import EnvStepError
from gym_resilience.testing import ScriptableEnv, echo_step


def step_that_drops_the_connection_on_turn_2(
    env: ScriptableEnv, action: Any
) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
    if env.turn == 2:
        raise ConnectionError("tool server closed the connection")
    return echo_step(env, action)


def main() -> None:
    inner = ScriptableEnv(step=step_that_drops_the_connection_on_turn_2)
    env = ResilientEnv(inner)
    observation, _ = env.reset(seed=0)
    print(f"reset    -> {observation!r}")
    try:
        for command in ["ls", "cat README.md", "pytest -q", "git diff"]:
            observation, *_ = env.step(command)
            print(f"step     -> {observation!r}")
    except EnvStepError as error:
        print(f"failed   -> {type(error).__name__}: {error}")
        print(f"cause    -> {type(error.__cause__).__name__}: {error.__cause__}")
        print(f"turn     -> {error.turn}, action {error.action_repr}")
    print(f"closed   -> {env.closed}; the inner close() ran {inner.close_calls} time(s)")
    env.close()  # the caller's own cleanup is harmless: close runs once
    print(f"again    -> still {inner.close_calls} time(s) after another close()")


if __name__ == "__main__":
    main()
