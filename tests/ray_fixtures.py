"""The session's Ray cluster: three real nodes on 127.0.0.1, inside a loopback-only network namespace.

One cluster serves every test that asks for ``ray_cluster`` (starting one takes 10-20 s on a two-core
machine). The fixture moves the main thread into the namespace before it starts the cluster and connects
this process as its driver, so that Ray's threads and the runner's thread pools, created afterwards, are
in it too; it returns the thread to the namespace it came from when the session ends.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from harness.run.cluster import LocalCluster

CLUSTER_NODES = 3
# The network namespace this process started in, opened before any fixture moves the main thread: tests of
# the namespaces themselves run from it, whichever tests ran before them.
ORIGIN_NAMESPACE = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[LocalCluster]:
    """A running 3-node cluster (one CPU per node) that this process is connected to as its driver."""
    # Imported here: ray takes a second to import, and most test runs never start a cluster.
    from harness.run.cluster import LocalCluster
    from harness.run.netns import loopback_namespace

    # Actors import the envs of the tests by reference (cloudpickle): from this folder, or from the folder
    # of the test module that defines them (pytest imports a module by its own folder's name).
    folders = [
        TESTS,
        *sorted(path for path in TESTS.iterdir() if path.is_dir() and any(path.glob("test_*.py"))),
    ]
    environment = {
        "PYTHONPATH": os.pathsep.join([*map(str, folders), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
    }
    with loopback_namespace(), LocalCluster(CLUSTER_NODES, environment=environment) as cluster:
        yield cluster


def run_cluster_tests_last(items: list[pytest.Item]) -> None:
    """Move the tests that use the cluster to the end of the run, keeping their order.

    Once the cluster started, the main thread stays in its loopback-only namespace (Ray's driver lives
    there): a later test's listener on 127.0.0.1 would be out of reach of a worker process forked
    from outside it. Running the cluster's tests last keeps every other test in the namespace it began in.
    """
    items.sort(key=lambda item: "ray_cluster" in getattr(item, "fixturenames", ()))
