"""The node killer: injects a plan's ``kill_node`` ray faults by removing worker nodes of the cluster.

A thread of the harness process that watches the run's spans as its recorder receives them, so it sees
env steps wherever they run.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Protocol

from harness.faults.events import Span, reset_nodes
from harness.faults.plan import FaultPlan
from harness.scenario.spec import RayFault

__all__ = ["Calls", "Cluster", "NodeKiller"]


class Calls(Protocol):
    """What :class:`NodeKiller` reads of the run's recorder (``harness.run.recorder.Recorder``)."""

    def spans(self) -> list[Span]:
        """Every span reported so far, by any process."""
        ...


class Cluster(Protocol):
    """What :class:`NodeKiller` needs of a local Ray cluster (``harness.run.cluster.LocalCluster``)."""

    def worker_node_ids(self) -> list[str]: ...

    def remove_node(self, node_id: str) -> None: ...


class NodeKiller:
    """Injects a plan's ``kill_node`` faults: a thread that watches the run's spans and, once a fault's
    ``after_steps`` env steps have ended, removes one worker node of ``cluster``.

    The node is the fault's ``node`` (an index into ``cluster.worker_node_ids()`` as it was when the
    killer started), else the node hosting the most env actors: attempts whose ``reset`` logged that node
    and whose ``close`` has not been logged (ties: the lowest index). Each fault fires at most once.
    Use it as a context manager around the batch; leaving it stops the thread (a removal under way
    finishes first).

    Args:
        plan: The faults; only its ``kill_node`` faults are used.
        calls: The faulted run's recorder, to which its envs report their spans.
        cluster: The cluster whose worker nodes are removed.
        poll_s: How often the spans are read.
    """

    def __init__(self, plan: FaultPlan, calls: Calls, cluster: Cluster, *, poll_s: float = 0.05) -> None:
        self.plan = plan
        self.calls = calls
        self.cluster = cluster
        self.poll_s = poll_s
        self._pending = plan.ray_faults("kill_node")
        self._workers: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gym-resilience-node-killer", daemon=True)
        self.error: BaseException | None = None
        """What stopped the watcher early (a removal that failed), re-raised when the block is left."""

    def __enter__(self) -> NodeKiller:
        if self._pending:
            self._workers = self.cluster.worker_node_ids()
            self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.error is not None and exc is None:
            raise self.error

    def _watch(self) -> None:
        try:
            while self._pending and not self._stop.wait(self.poll_s):
                spans = self.calls.spans()
                steps = sum(1 for span in spans if span.kind == "step" and span.end_s is not None)
                due = [(i, f) for i, f in self._pending if steps >= f.after_steps]
                for index, fault in due:
                    self._kill(index, fault, spans, steps)
                    self._pending.remove((index, fault))
        except BaseException as exc:  # the batch goes on; the run reports this when the block is left
            self.error = exc

    def _kill(self, index: int, fault: RayFault, spans: Sequence[Span], steps: int) -> None:
        hosted = _actors_per_node(spans)
        if fault.node is not None:
            position = fault.node
        else:
            # The node hosting the most env actors; ties go to the lowest index.
            position = max(range(len(self._workers)), key=lambda i: (hosted.get(self._workers[i], 0), -i))
        node = self._workers[position]
        self.cluster.remove_node(node)
        self.plan.record(
            index,
            rollout=None,
            attempt=None,
            turn=None,
            detail=(
                f"removed worker node {position} ({node[:12]}), hosting {hosted.get(node, 0)} env actors, "
                f"after {steps} env steps"
            ),
        )


def _actors_per_node(spans: Sequence[Span]) -> dict[str, int]:
    """How many attempts' envs each node hosts: reset there, and not closed yet."""
    closed = {(s.rollout, s.attempt) for s in spans if s.kind == "close"}
    counts: dict[str, int] = {}
    for (rollout, attempt), node in reset_nodes(spans).items():
        if (rollout, attempt) not in closed:
            counts[node] = counts.get(node, 0) + 1
    return counts
