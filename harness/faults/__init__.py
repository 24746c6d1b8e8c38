"""The second stage: a scenario's faults decided (``plan``) and injected where they hit: into env
calls (``env``), engine calls (``engine``), the Ray cluster's nodes (``nodes``) and TCP links
(``proxy``); every firing and every call (a span) is reported to the run's recorder (``events``). What
each fault kind is is one entry of ``harness.scenario.kinds``; what it does, one entry of its target's
injector table (``ENV_INJECTORS``, ``ENGINE_INJECTORS``, ``NETWORK_INJECTORS``; ``injectors``)."""

from harness.faults.engine import ENGINE_INJECTORS, FaultyEngine
from harness.faults.env import (
    BAD_RESET_OBSERVATION,
    BAD_REWARD,
    BAD_STEP_OBSERVATION,
    ENV_INJECTORS,
    HANG_S,
    FaultyEnv,
    FaultyEnvFactory,
    ray_placement,
)
from harness.faults.events import FaultFiring, RunEvents, Span, SpanKind, record_span, reset_nodes, timed_call
from harness.faults.injectors import Injector
from harness.faults.nodes import NodeKiller
from harness.faults.plan import FaultPlan, connection_fires, draw, request_fires
from harness.faults.proxy import NETWORK_INJECTORS

__all__ = [
    "BAD_RESET_OBSERVATION",
    "BAD_REWARD",
    "BAD_STEP_OBSERVATION",
    "ENGINE_INJECTORS",
    "ENV_INJECTORS",
    "HANG_S",
    "NETWORK_INJECTORS",
    "FaultFiring",
    "FaultPlan",
    "FaultyEngine",
    "FaultyEnv",
    "FaultyEnvFactory",
    "Injector",
    "NodeKiller",
    "RunEvents",
    "Span",
    "SpanKind",
    "connection_fires",
    "draw",
    "ray_placement",
    "record_span",
    "request_fires",
    "reset_nodes",
    "timed_call",
]
