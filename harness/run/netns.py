"""A network namespace with only ``lo``, so that a local Ray cluster cannot listen or connect off-machine.

Ray picks its node's address from the primary interface, even when told ``127.0.0.1`` for some of its
servers, and then listens there. Inside a fresh network namespace the only interface is ``lo``: whatever
a cluster started there binds to is loopback, and nothing outside the namespace can reach it (nor can it
reach out).

Linux moves one *thread* at a time: ``unshare(CLONE_NEWNET)`` moves only the calling thread, and the
threads and processes it creates afterwards are born in its namespace. That is what tests and scenarios
rely on: enter the namespace first, then start the cluster, connect the driver (its threads) and create
the runner's thread pools. Threads created before stay where they were. It needs ``CAP_SYS_ADMIN`` (root,
as in CI, or a user namespace).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import socket
import struct
import sys
from collections.abc import Iterator

__all__ = [
    "LoopbackNamespaceError",
    "enter_loopback_namespace",
    "in_loopback_namespace",
    "join_namespace",
    "loopback_namespace",
    "open_namespace",
]

_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = "16sH22x"  # struct ifreq: the interface's name, then ifr_flags in the union (40 bytes on Linux)
_THREAD_NET_NS = "/proc/thread-self/ns/net"


class LoopbackNamespaceError(OSError):
    """Raised when the calling thread cannot enter, or return from, a loopback-only network namespace.

    ``step`` names the system call that failed (``unshare``, ``setns``, ``ioctl``); ``errno`` and
    ``strerror`` are its error. ``EPERM`` means the process lacks ``CAP_SYS_ADMIN``: run as root (CI
    does), or under ``unshare --user --map-root-user --net``.
    """

    def __init__(self, *, step: str, error_number: int) -> None:
        self.step = step
        hint = (
            ": creating a network namespace needs CAP_SYS_ADMIN; run as root, or start the program "
            "under `unshare --user --map-root-user --net`"
            if error_number in (errno.EPERM, errno.EACCES)
            else ""
        )
        super().__init__(error_number, f"{step} failed: {os.strerror(error_number)}{hint}")

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (self.step, self.errno))


def _rebuild(step: str, error_number: int) -> LoopbackNamespaceError:
    return LoopbackNamespaceError(step=step, error_number=error_number)


def _libc() -> ctypes.CDLL:
    if sys.platform != "linux":
        raise LoopbackNamespaceError(step="unshare", error_number=errno.ENOSYS)
    return ctypes.CDLL(None, use_errno=True)


def in_loopback_namespace() -> bool:
    """Whether the calling thread's network namespace has no interface but ``lo``."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def _bring_loopback_up() -> None:
    """Sets ``IFF_UP`` on ``lo`` (a new namespace's ``lo`` is down), as ``ip link set lo up`` does."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            request = struct.pack(_IFREQ, b"lo", 0)
            _, flags = struct.unpack(_IFREQ, fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, request))
            if not flags & _IFF_UP:
                fcntl.ioctl(sock.fileno(), _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))
        except OSError as exc:
            raise LoopbackNamespaceError(step="ioctl", error_number=exc.errno or errno.EIO) from exc


def enter_loopback_namespace() -> None:
    """Moves the calling thread into a new network namespace with only ``lo``, and brings ``lo`` up.

    A thread already in a loopback-only namespace stays in it (``lo`` is brought up if it is down).

    Raises:
        LoopbackNamespaceError: the system refused (``EPERM``: no ``CAP_SYS_ADMIN``), or this is not
            Linux.
    """
    if not in_loopback_namespace():
        libc = _libc()
        if libc.unshare(_CLONE_NEWNET) != 0:
            raise LoopbackNamespaceError(step="unshare", error_number=ctypes.get_errno())
    _bring_loopback_up()


@contextlib.contextmanager
def loopback_namespace() -> Iterator[None]:
    """Runs the block with the calling thread in a loopback-only namespace, then returns it where it was.

    Threads and processes created inside the block stay in the namespace; it goes away once the last
    of them is gone.

    Raises:
        LoopbackNamespaceError: entering or returning failed.
    """
    origin = open_namespace()
    try:
        enter_loopback_namespace()
        try:
            yield
        finally:
            join_namespace(origin)
    finally:
        os.close(origin)


def open_namespace() -> int:
    """A file descriptor of the calling thread's network namespace, for :func:`join_namespace` (close it)."""
    _libc()
    return os.open(_THREAD_NET_NS, os.O_RDONLY | os.O_CLOEXEC)


def join_namespace(namespace: int) -> None:
    """Moves the calling thread into the network namespace ``namespace`` (from :func:`open_namespace`).

    Raises:
        LoopbackNamespaceError: the system refused.
    """
    if _libc().setns(namespace, _CLONE_NEWNET) != 0:
        raise LoopbackNamespaceError(step="setns", error_number=ctypes.get_errno())
