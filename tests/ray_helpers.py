"""What the Ray backend's tests share: the env actor's class, the bound that proves something ends, and
checks that a cluster's env actors are dead (Ray applies a kill asynchronously: the checks wait for it)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from gym_resilience.testing import ScriptableEnv
from harness.run.cluster import LocalCluster

HOST = "_EnvHost"  # the class of an env's actor
GIVE_UP_S = 60.0  # a bound that proves something ends, never a speed check


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + GIVE_UP_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {GIVE_UP_S:g} s: {what}")
        time.sleep(0.05)


def assert_dead(cluster: LocalCluster, *actor_ids: str) -> None:
    wait_until(lambda: not cluster.alive_actors(HOST) & set(actor_ids), f"actors {actor_ids} dead")


def assert_no_env_actor_alive(cluster: LocalCluster) -> None:
    wait_until(lambda: not cluster.alive_actors(HOST), "every env actor dead")


def raise_value_error(env: ScriptableEnv, action: Any) -> Any:
    """A ScriptableEnv step that raises: module-level, since an actor unpickles it by reference."""
    raise ValueError(f"bad move {action!r}")


async def remove_node(cluster: LocalCluster, node_id: str) -> None:
    """Remove worker node ``node_id`` without blocking the event loop, from a thread made now, in this
    thread's network namespace (a pool's older threads may not be in it)."""
    remover = threading.Thread(target=cluster.remove_node, args=(node_id,))
    remover.start()
    await asyncio.to_thread(remover.join)


def restore_nodes(cluster: LocalCluster, removed: str) -> None:
    """Add a node back if ``removed`` is gone, so that the next tests get the cluster's nodes again."""
    if removed not in cluster.worker_node_ids():
        cluster.add_node()
