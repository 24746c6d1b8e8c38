"""Runs on a cluster: the loopback-only network namespace a scenario's local Ray cluster needs, the
cluster started for one scenario, and env actors pinned where the scenario says.

The CLI and the pytest plugin enter the namespace at startup (:func:`enter_cluster_namespace`), before
any thread or server starts, so everything else the harness runs on 127.0.0.1 lives in it too. Ray is
imported only when a scenario declares a cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from gym_resilience import RunnerConfig
from harness.scenario.compile import CompiledScenario

if TYPE_CHECKING:
    from harness.run.cluster import LocalCluster

__all__ = ["ClusterUnavailableError", "cluster_for", "enter_cluster_namespace", "placed"]


class ClusterUnavailableError(RuntimeError):
    """Raised when a scenario declares a cluster and this process is not in a loopback-only network
    namespace, the only place the harness starts a Ray cluster."""


def enter_cluster_namespace() -> str | None:
    """Moves the calling thread into a loopback-only network namespace, where scenarios that declare a
    cluster can run; returns why it could not (those scenarios then fail, saying so), or None.

    Call it before any thread or server starts: threads started earlier stay outside, and a server
    listening outside is out of reach from inside.
    """
    from harness.run.netns import LoopbackNamespaceError, enter_loopback_namespace

    try:
        enter_loopback_namespace()
    except LoopbackNamespaceError as exc:
        return f"cannot run scenarios that declare a cluster: {exc.strerror}"
    return None


@contextlib.contextmanager
def cluster_for(scenario: CompiledScenario) -> Iterator[LocalCluster | None]:
    """The scenario's local Ray cluster, started for it and shut down after it; None if it declares none."""
    spec = scenario.spec.cluster
    if spec is None:
        yield None
        return
    from harness.run.netns import in_loopback_namespace

    if not in_loopback_namespace():
        raise ClusterUnavailableError(
            "the scenario declares a cluster, and the harness starts Ray clusters only inside a "
            "loopback-only network namespace, which it enters at startup when it can: that needs "
            "CAP_SYS_ADMIN (run as root, or under `unshare --user --map-root-user --net`)"
        )
    from harness.run.cluster import LocalCluster

    # Env actors import the user's env factory by name, from the folders the scenario imports it from.
    folder = scenario.file.parent.absolute()
    folders = [folder, *(folder / Path(entry).expanduser() for entry in scenario.spec.python_path)]
    inherited = os.environ.get("PYTHONPATH")
    path = os.pathsep.join([*(str(f) for f in folders), *([inherited] if inherited else [])])
    with LocalCluster(
        spec.nodes, cpus_per_node=spec.cpus_per_node, environment={"PYTHONPATH": path}
    ) as cluster:
        yield cluster


def placed(config: RunnerConfig, scenario: CompiledScenario, cluster: LocalCluster | None) -> RunnerConfig:
    """``config`` with the env actors pinned to the worker node ``cluster.envs_on_worker`` names, if any."""
    spec = scenario.spec.cluster
    if cluster is None or spec is None or spec.envs_on_worker is None:
        return config
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = cluster.worker_node_ids()[spec.envs_on_worker]
    strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
    options = {**(config.env_actor_options or {}), "scheduling_strategy": strategy}
    return dataclasses.replace(config, env_actor_options=options)
