"""The loopback-only network namespace that local Ray clusters run in: real namespaces, real sockets.

Each test runs its body in a thread of its own, which starts in the namespace this process started in
(the session's Ray cluster may have moved the main thread since), so the namespace it enters never
leaks into the main thread (nor into the threads that later tests create).
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from ray_fixtures import ORIGIN_NAMESPACE

from harness.run.netns import (
    LoopbackNamespaceError,
    enter_loopback_namespace,
    in_loopback_namespace,
    join_namespace,
    loopback_namespace,
)

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[3]


def in_new_thread(body: Callable[[], T], *, namespace: int | None = ORIGIN_NAMESPACE) -> T:
    """``body()`` run in a fresh thread, moved first to ``namespace`` (None: its creator's); what it raised
    is raised here."""
    results: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            if namespace is not None:
                join_namespace(namespace)
            results.append(body())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return results[0]


def namespace_id() -> int:
    return os.stat("/proc/thread-self/ns/net").st_ino


def test_this_test_process_starts_outside_a_loopback_namespace() -> None:
    # The other tests' "outside" must be a namespace with a real interface besides lo.
    assert not in_new_thread(in_loopback_namespace)


def test_a_socket_made_inside_cannot_reach_a_listener_made_outside() -> None:
    def body() -> None:
        with socket.create_server(("127.0.0.1", 0)) as outside:
            port = outside.getsockname()[1]
            with loopback_namespace(), pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
            # The listener was there all along: from outside, the same address answers.
            socket.create_connection(("127.0.0.1", port), timeout=5).close()

    in_new_thread(body)


def test_inside_only_lo_exists_and_it_carries_connections() -> None:
    def inside() -> tuple[list[str], bytes]:
        with loopback_namespace():
            names = [name for _, name in socket.if_nameindex()]
            server = socket.create_server(("127.0.0.1", 0))
            with server, socket.create_connection(server.getsockname(), timeout=5) as client:
                accepted, _ = server.accept()
                with accepted:
                    client.sendall(b"ping")
                    return names, accepted.recv(4)

    assert in_new_thread(inside) == (["lo"], b"ping")


def test_the_thread_returns_to_its_namespace_on_exit_and_threads_made_inside_stay_inside() -> None:
    def body() -> tuple[int, int, int, int, bool]:
        before = namespace_id()
        with loopback_namespace():
            inside = namespace_id()
            child = in_new_thread(namespace_id, namespace=None)
        return before, inside, child, namespace_id(), in_loopback_namespace()

    before, inside, child, after, still_inside = in_new_thread(body)
    assert inside != before
    assert child == inside
    assert after == before
    assert not still_inside


def test_entering_twice_stays_in_the_same_namespace() -> None:
    def body() -> tuple[int, int]:
        with loopback_namespace():
            first = namespace_id()
            enter_loopback_namespace()
            return first, namespace_id()

    first, second = in_new_thread(body)
    assert first == second


def test_a_process_without_cap_sys_admin_gets_an_error_that_says_what_to_do() -> None:
    # A real process that gave up root (after its imports: nobody cannot read this checkout); the kernel
    # then refuses unshare(CLONE_NEWNET) with EPERM.
    code = (
        "import os; from harness.run.netns import enter_loopback_namespace; "
        "os.setgroups([]); os.setgid(65534); os.setuid(65534); enter_loopback_namespace()"
    )
    command = [sys.executable, "-c", code]
    result = in_new_thread(
        lambda: subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    )
    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line == (
        "harness.run.netns.LoopbackNamespaceError: [Errno 1] unshare failed: Operation not permitted: "
        "creating a "
        "network namespace needs CAP_SYS_ADMIN; run as root, or start the program under "
        "`unshare --user --map-root-user --net`"
    )


def test_the_error_pickles_with_its_step_and_errno() -> None:
    error = LoopbackNamespaceError(step="setns", error_number=1)
    restored = pickle.loads(pickle.dumps(error))
    assert (type(restored), restored.step, restored.errno, str(restored)) == (
        LoopbackNamespaceError,
        "setns",
        1,
        str(error),
    )
