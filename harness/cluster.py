"""``harness.cluster``, as docs/ray.md names it: the local Ray cluster lives in ``harness.run.cluster``."""

from harness.run.cluster import DEFAULT_SYSTEM_CONFIG, ActorRecord, LocalCluster, LocalClusterError

__all__ = ["DEFAULT_SYSTEM_CONFIG", "ActorRecord", "LocalCluster", "LocalClusterError"]
