"""The second stage: a scenario's faults decided (``plan``) and injected where they hit: into env
calls (``env``), engine calls (``engine``), the Ray cluster's nodes (``nodes``) and TCP links
(``proxy``); every call is logged as a span (``spans``). What each fault kind is and does is one entry of
``harness.scenario.kinds``."""

from harness.faults.engine import FaultyEngine
from harness.faults.env import (
    BAD_RESET_OBSERVATION,
    BAD_REWARD,
    BAD_STEP_OBSERVATION,
    HANG_S,
    FaultyEnv,
    FaultyEnvFactory,
    ray_placement,
)
from harness.faults.nodes import NodeKiller
from harness.faults.plan import FaultFiring, FaultPlan, connection_fires, draw, read_firings, request_fires
from harness.faults.spans import Span, SpanKind, SpanLog, reset_nodes

__all__ = [
    "BAD_RESET_OBSERVATION",
    "BAD_REWARD",
    "BAD_STEP_OBSERVATION",
    "HANG_S",
    "FaultFiring",
    "FaultPlan",
    "FaultyEngine",
    "FaultyEnv",
    "FaultyEnvFactory",
    "NodeKiller",
    "Span",
    "SpanKind",
    "SpanLog",
    "connection_fires",
    "draw",
    "ray_placement",
    "read_firings",
    "request_fires",
    "reset_nodes",
]
