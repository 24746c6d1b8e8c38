"""A real multi-node Ray cluster on this machine, for tests and scenarios: ``with LocalCluster(3):``.

Every node is a real raylet (with its object store and workers) started by Ray's own
``ray.cluster_utils.Cluster``; the head also runs the GCS. They all listen on 127.0.0.1, and since Ray
picks a node's address from the primary interface however it is told, the cluster runs only inside a
loopback-only network namespace (:mod:`harness.run.netns`): enter it first. The dashboard is off and each
object store small (80 MB), so three nodes fit a two-core, 24 GB machine. This process is connected as
the cluster's driver (``ray.init``) while the block runs; on exit it disconnects, stops every node and
checks that no process of the cluster is left. One cluster at a time.

Ray's own output is kept to what matters: it does not look for this machine's address towards 8.8.8.8
(which fails in the namespace, with a warning each time: the address is 127.0.0.1, and Ray is told so),
and its driver logs warnings and errors only. What Ray cannot be kept from printing is its report of a
worker that died while running a task ("A worker died or was killed ... by an unexpected system error",
guessing at the OOM killer), which the driver prints for every env worker a ``kill_actor`` fault SIGKILLs
on purpose; the command line says so before a run with such faults.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import psutil  # type: ignore[import-untyped]
import ray
import ray._private.ray_constants
from ray.cluster_utils import Cluster

from harness.run.netns import in_loopback_namespace

__all__ = ["DEFAULT_SYSTEM_CONFIG", "ActorRecord", "LocalCluster", "LocalClusterError"]

DEFAULT_SYSTEM_CONFIG: Mapping[str, Any] = {
    # A node killed without notice is declared dead after 3 missed health checks, 0.5 s apart, instead of
    # Ray's 5 missed checks 3 s apart: a test does not wait 15 s for it.
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 3,
    # Each env actor is a worker process of its own; starting 4 of them at once per node instead of
    # one per CPU lets a one-CPU node take a batch's actors in a few seconds.
    "worker_maximum_startup_concurrency": 4,
}
"""Ray system settings of a :class:`LocalCluster` unless ``system_config`` overrides them."""

_STOP_GRACE_S = 10.0
_lock = threading.Lock()
_running: LocalCluster | None = None


@dataclass(frozen=True, slots=True)
class ActorRecord:
    """One actor as the cluster's GCS knows it; ``state`` is ``ALIVE``, ``DEAD``, ``PENDING_CREATION``...;
    ``pid`` is its worker process's (0 before it has one). The GCS marks a killed actor ``DEAD`` before
    that process has exited."""

    actor_id: str
    class_name: str
    state: str
    node_id: str
    pid: int


class LocalClusterError(RuntimeError):
    """Raised when a local cluster cannot start where it is asked to, or left processes behind."""


class LocalCluster:
    """A head node and ``nodes - 1`` worker nodes on 127.0.0.1, this process connected as the driver.

    Args:
        nodes: Nodes in all, the head included (>= 1).
        cpus_per_node: CPUs each node offers to Ray's scheduler (not a limit on what its processes use).
        object_store_mb: Each node's object store.
        system_config: Ray system settings over :data:`DEFAULT_SYSTEM_CONFIG` (the head sets them for all).
        environment: Variables set for every process of the cluster, workers included (say,
            ``PYTHONPATH``, so that actors import code the driver imports from outside installed packages).
    """

    def __init__(
        self,
        nodes: int,
        *,
        cpus_per_node: float = 1,
        object_store_mb: int = 80,
        system_config: Mapping[str, Any] | None = None,
        environment: Mapping[str, str] | None = None,
    ) -> None:
        if nodes < 1:
            raise ValueError(f"a cluster has at least one node, got nodes={nodes}")
        self.nodes = nodes
        self.cpus_per_node = cpus_per_node
        self.object_store_mb = object_store_mb
        self.system_config = {**DEFAULT_SYSTEM_CONFIG, **(system_config or {})}
        self.environment = dict(environment or {})
        self._cluster: Cluster | None = None
        self._workers: dict[str, Any] = {}  # node id (hex) -> ray._private.node.Node
        self._started: dict[int, psutil.Process] = {}  # every process the cluster started, by pid
        self._restore: list[Callable[[], None]] = []  # what undoes _quiet_ray's changes, for _stop

    # --- the cluster's life -----------------------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        global _running
        if not in_loopback_namespace():
            raise LocalClusterError(
                "a LocalCluster runs only inside a loopback-only network namespace, or Ray would listen on "
                "this machine's primary interface: call harness.run.netns.enter_loopback_namespace() first"
            )
        with _lock:
            if _running is not None or ray.is_initialized():
                raise LocalClusterError("one Ray cluster at a time: this process is already connected to one")
            _running = self
        try:
            self._quiet_ray()
            with self._environment():
                self._cluster = Cluster(
                    initialize_head=True,
                    head_node_args={**self._node_args(), "_system_config": dict(self.system_config)},
                )
            for _ in range(self.nodes - 1):
                self.add_node()
            ray.init(
                address=self._cluster.address,
                _node_ip_address="127.0.0.1",
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        left = self._stop()
        if left and exc is None:
            raise LocalClusterError(f"processes of the cluster outlived its shutdown (killed now): {left}")

    def _stop(self) -> list[str]:
        """Disconnects, stops every node, and kills what is left; returns what had to be killed."""
        global _running
        self._remember_processes()
        try:
            ray.shutdown()
            if self._cluster is not None:
                self._cluster.shutdown()  # type: ignore[no-untyped-call]
        finally:
            _, alive = psutil.wait_procs(list(self._started.values()), timeout=_STOP_GRACE_S)
            left = []
            for process in alive:
                try:
                    left.append(f"{process.pid} {process.name()}")
                    process.kill()
                except psutil.NoSuchProcess:
                    pass
            self._cluster = None
            self._workers.clear()
            while self._restore:
                self._restore.pop()()
            with _lock:
                _running = None
        return left

    def _quiet_ray(self) -> None:
        """Keeps Ray's chatter out of the driver's output while the cluster runs (undone by ``_stop``).

        Ray resolves "this node's address" (when it checks a new node's version, and twice in
        ``ray.init``, even when given ``127.0.0.1``) by opening a socket towards 8.8.8.8 and
        2001:4860:4860::8888; in the loopback-only namespace that fails, and its C++ core warns each time
        ("Failed to determine local IP via external connectivity"). Where Ray clusters are off
        (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read into this constant when ray is imported) it answers
        with the loopback address instead, without asking outside: the one answer in this namespace.
        Ray's driver logs its connection at INFO ("Connecting to existing Ray cluster"): WARNING and up
        only, as for vLLM.
        """
        constants = ray._private.ray_constants
        if getattr(constants, "ENABLE_RAY_CLUSTER", None) is True:
            constants.ENABLE_RAY_CLUSTER = False
            self._restore.append(lambda: setattr(constants, "ENABLE_RAY_CLUSTER", True))
        logger = logging.getLogger("ray")
        level = logger.level
        logger.setLevel(max(level, logging.WARNING))
        self._restore.append(lambda: logger.setLevel(level))

    def _node_args(self) -> dict[str, Any]:
        return {
            "num_cpus": self.cpus_per_node,
            "object_store_memory": self.object_store_mb * 1024 * 1024,
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
        }

    # --- nodes ------------------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The GCS address a driver passes to ``ray.init(address=...)``."""
        return str(self._live().address)

    @property
    def head_node_id(self) -> str:
        """The head node's id (hex)."""
        head = self._live().head_node
        assert head is not None  # a running cluster has its head
        return str(head.node_id)

    def worker_node_ids(self) -> list[str]:
        """The ids (hex) of the worker nodes still in the cluster, in the order they were added."""
        return list(self._workers)

    def add_node(self) -> str:
        """Starts one more worker node and waits until it is alive; returns its id (hex)."""
        with self._environment():
            node = self._live().add_node(wait=True, **self._node_args())
        node_id = str(node.node_id)
        self._workers[node_id] = node
        self._remember_processes()
        return node_id

    def remove_node(self, node_id: str, *, graceful: bool = True) -> None:
        """Stops a worker node: its raylet and every worker (actor) on it die.

        ``graceful=False`` SIGKILLs its processes, as a machine that vanishes: the cluster finds out
        only when the node misses its health checks.
        """
        if node_id not in self._workers:
            raise ValueError(f"{node_id} is not a worker node of this cluster: {self.worker_node_ids()}")
        self._remember_processes()
        self._live().remove_node(self._workers.pop(node_id), allow_graceful=graceful)

    # --- actors -----------------------------------------------------------------------------------------

    def actors(self, class_name: str | None = None) -> list[ActorRecord]:
        """Every actor the cluster has known, dead ones included (of ``class_name``, when given).

        Read from the GCS's own table, because Ray's state API (``ray.util.state``) is served by the
        dashboard, which needs ``ray[default]`` and is off here.
        """
        self._live()
        return [
            ActorRecord(
                actor_id=actor_id,
                class_name=str(info["ActorClassName"]),
                state=str(info["State"]),
                node_id=str(info["Address"]["NodeID"]),
                pid=int(info.get("Pid") or 0),
            )
            for actor_id, info in ray._private.state.actors().items()
            if class_name is None or info["ActorClassName"] == class_name
        ]

    def alive_actors(self, class_name: str | None = None) -> set[str]:
        """The ids of the actors (of ``class_name``, when given) that are not dead: alive, or on their way."""
        return {record.actor_id for record in self.actors(class_name) if record.state != "DEAD"}

    # --- what it started --------------------------------------------------------------------------------

    def processes(self) -> list[psutil.Process]:
        """Every process of the cluster still running: each node's own and their children (workers)."""
        self._remember_processes()
        return [process for process in self._started.values() if process.is_running()]

    def listening_addresses(self) -> set[tuple[str, int]]:
        """``(ip, port)`` of every TCP socket that a process of the cluster listens on."""
        addresses: set[tuple[str, int]] = set()
        for process in self.processes():
            try:
                connections = process.net_connections(kind="tcp")
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            addresses.update(
                (conn.laddr.ip, conn.laddr.port) for conn in connections if conn.status == psutil.CONN_LISTEN
            )
        return addresses

    def _remember_processes(self) -> None:
        """Adds the nodes' processes and their descendants to what the shutdown must see gone."""
        if self._cluster is None:
            return
        nodes = [self._cluster.head_node, *self._cluster.worker_nodes]
        for node in nodes:
            if node is None:
                continue
            for infos in node.all_processes.values():
                for info in infos:
                    self._remember(info.process.pid)

    def _remember(self, pid: int) -> None:
        try:
            process = psutil.Process(pid)
            family = [process, *process.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for member in family:
            self._started.setdefault(member.pid, member)

    @contextlib.contextmanager
    def _environment(self) -> Iterator[None]:
        """``environment`` in ``os.environ`` while a node starts: its processes inherit it, and theirs."""
        saved = {name: os.environ.get(name) for name in self.environment}
        os.environ.update(self.environment)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def _live(self) -> Cluster:
        if self._cluster is None:
            raise LocalClusterError("the cluster is not running: use it inside its `with` block")
        return self._cluster
