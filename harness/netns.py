"""``harness.netns``, as docs/ray.md names it: loopback-only network namespaces live in
``harness.run.netns``."""

from harness.run.netns import (
    LoopbackNamespaceError,
    enter_loopback_namespace,
    in_loopback_namespace,
    join_namespace,
    loopback_namespace,
    open_namespace,
)

__all__ = [
    "LoopbackNamespaceError",
    "enter_loopback_namespace",
    "in_loopback_namespace",
    "join_namespace",
    "loopback_namespace",
    "open_namespace",
]
