"""The typed form of a chaos scenario file (DESIGN.md §6): what to run, which faults, what must hold.

Models are frozen and reject unknown fields, so a typo in a scenario file is an error, not a silently
ignored key. Loading (YAML, line numbers, one clear error) lives in ``harness.loader``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "MAX_DELAY_S",
    "PROBES",
    "BatchSpec",
    "ConnectionTargeting",
    "EngineFault",
    "EngineSpec",
    "EnvFault",
    "Expect",
    "Fault",
    "NetworkFault",
    "Probe",
    "Scenario",
    "Targeting",
]


MAX_DELAY_S = 3600.0
"""The longest delay or latency a fault may add: a run of the suite is minutes, so more is a typo (a
``hang`` is the fault that never returns)."""

Seconds = Annotated[float, Field(gt=0, le=MAX_DELAY_S)]


class _Model(BaseModel):
    # NaN and infinity are refused everywhere: a tolerance of NaN never holds, an infinite delay never ends.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class Targeting(_Model):
    """Which calls a fault hits. Every given filter must match; an empty targeting hits every call.

    ``rollouts``, ``turns`` and ``attempts`` are 0-based indices (a retried rollout's second try is
    attempt 1). ``nth_call`` counts, per fault, the calls that passed the other filters (0-based) and is
    only deterministic for calls that happen in a fixed order. ``probability`` draws from a generator
    seeded by the scenario's seed, the fault's position and (rollout, attempt, turn), so a run
    replays identically whatever the scheduling.
    """

    rollouts: list[Annotated[int, Field(ge=0)]] | None = None
    turns: list[Annotated[int, Field(ge=0)]] | None = None
    attempts: list[Annotated[int, Field(ge=0)]] | None = None
    nth_call: list[Annotated[int, Field(ge=0)]] | None = None
    probability: Annotated[float, Field(ge=0.0, le=1.0)] | None = None


class ConnectionTargeting(_Model):
    """Which requests (or TCP connections) through the fault proxy a network fault hits.

    By default a network fault targets HTTP requests, by the rollout each one serves: the client names
    it in the ``x-gym-resilience-rollout`` header (the bundled tool env and ``OpenAIEngine`` do), so
    ``rollouts``, ``turns`` and ``attempts`` hit the same requests on every run, whatever the timing.
    ``probability`` draws per (rollout, attempt, turn). A request without the header is hit only by a
    fault with none of these filters. ``nth_connection`` instead counts TCP connections in accept order
    (0-based): that order changes with scheduling, so it is only deterministic for a client that
    connects in a fixed order; it cannot be combined with the rollout filters.
    """

    rollouts: list[Annotated[int, Field(ge=0)]] | None = None
    turns: list[Annotated[int, Field(ge=0)]] | None = None
    attempts: list[Annotated[int, Field(ge=0)]] | None = None
    nth_connection: list[Annotated[int, Field(ge=0)]] | None = None
    probability: Annotated[float, Field(ge=0.0, le=1.0)] | None = None

    @model_validator(mode="after")
    def _connections_or_requests(self) -> ConnectionTargeting:
        if self.nth_connection is not None and self.by_request_identity:
            raise ValueError(
                "nth_connection counts connections; it cannot be combined with rollouts, turns or attempts"
            )
        return self

    @property
    def by_request_identity(self) -> bool:
        """Whether the targeting names rollouts, turns or attempts."""
        return any(f is not None for f in (self.rollouts, self.turns, self.attempts))


class EnvFault(_Model):
    """A fault in the env: ``raise`` an exception (by name), ``delay`` the call, ``hang`` past any
    deadline, ``interrupt`` with KeyboardInterrupt, or return ``bad_output`` (wrong types).
    """

    target: Literal["env"]
    kind: Literal["raise", "delay", "hang", "interrupt", "bad_output"]
    method: Literal["reset", "step", "close"] = "step"
    exception: str = "RuntimeError"
    message: str = "injected fault"
    delay_s: Seconds = 0.5
    when: Targeting = Targeting()


class EngineFault(_Model):
    """A fault in generation: ``raise`` before generating, ``delay`` it, end it with finish reason
    ``abort``, or ``kill`` (SIGKILL) served vLLM process number ``server`` once ``after_requests``
    requests were sent to the engine.
    """

    target: Literal["engine"]
    kind: Literal["raise", "delay", "abort", "kill"]
    exception: str = "RuntimeError"
    message: str = "injected fault"
    delay_s: Seconds = 0.5
    server: Annotated[int, Field(ge=0)] = 0
    after_requests: Annotated[int, Field(ge=0)] = 0
    when: Targeting = Targeting()


class NetworkFault(_Model):
    """A fault on a real TCP connection through the loopback fault proxy in front of ``link``:
    ``latency`` (each chunk delayed ``latency_s``), ``reset_peer`` (the connection is reset), ``timeout``
    (data stops flowing; the client's own timeout fires). On the engine link each served endpoint has
    its own proxy (and connection count); ``endpoint`` picks one, None puts the fault on all of them.
    """

    target: Literal["network"]
    kind: Literal["latency", "reset_peer", "timeout"]
    link: Literal["engine", "tool"]
    endpoint: Annotated[int, Field(ge=0)] | None = None
    latency_s: Seconds = 0.05
    when: ConnectionTargeting = ConnectionTargeting()


Fault = Annotated[EnvFault | EngineFault | NetworkFault, Field(discriminator="target")]


class EngineSpec(_Model):
    """The engine: in-process vLLM, or ``servers`` vLLM OpenAI servers behind ``OpenAIEngine``."""

    kind: Literal["vllm", "served"] = "vllm"
    servers: Annotated[int, Field(ge=1, le=4)] = 1
    max_model_len: Annotated[int, Field(ge=64)] = 512


class BatchSpec(_Model):
    """The batch: ``tasks`` tasks for one of the bundled envs, generated from ``seed``."""

    env: Literal["word_game", "tool_use"] = "word_game"
    tasks: Annotated[int, Field(ge=1, le=512)] = 8
    seed: int | None = None


class Expect(_Model):
    """The expected outcome: the batch ``completes``, or ``raises`` an error of type ``error``."""

    outcome: Literal["completes", "raises"] = "completes"
    error: str | None = None

    @model_validator(mode="after")
    def _error_matches_outcome(self) -> Expect:
        if self.outcome == "raises" and not self.error:
            raise ValueError("outcome 'raises' needs the expected error type in 'error'")
        if self.outcome == "completes" and self.error:
            raise ValueError("'error' only goes with outcome 'raises'")
        return self


PROBES: dict[str, str] = {
    "batch_size": "trajectories in the faulted batch",
    "validator_passes": "the faulted batch passes validate_batch_output",
    "failed": "rollouts that failed (placeholders stand in for them)",
    "placeholders": "placeholder trajectories in the faulted batch",
    "envs_unclosed": "envs created but never closed, over both runs",
    "identical_to_baseline": (
        "every successful trajectory equals the fault-free run's, token for token (up to numerical ties)"
    ),
    "error_type": "the type name of the error the faulted run raised (none: it completed)",
    "wall_time_ratio": "faulted run's wall time / fault-free run's (machine load moves it: see the docs)",
    "wall_over_injected_latency": (
        "faulted run's wall time / the most network latency injected into one rollout (>= 1: it was applied)"
    ),
    "numerical_ties": "successful trajectories that left the baseline at a numerical tie of two tokens",
    "retries": "rollout retries in the faulted run",
    "retries_succeeded": "retried rollouts that then succeeded",
    "failovers": "requests a served engine moved to another endpoint",
    "faults_fired": "times any fault fired",
    "masked_groups": "groups whose loss masks mask_group zeroed",
    "token_level_rewards": "every reward is a per-token list",
    "logprobs_per_token": "every row has one finite logprob <= 0 per response token",
}
"""Every probe a scenario may name, and what it observes. ``metrics.<key>`` reads a runner metric."""


class Probe(_Model):
    """One steady-state check: the observation ``probe`` against exactly one tolerance.

    ``eq`` (equal), ``lte`` / ``gte`` (at most / at least), ``range`` ([low, high], inclusive) or
    ``is`` (true / false).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)

    probe: str
    eq: int | float | str | bool | None = None
    lte: float | None = None
    gte: float | None = None
    range: tuple[float, float] | None = None
    is_: bool | None = Field(default=None, alias="is")

    @model_validator(mode="after")
    def _one_known_probe_one_tolerance(self) -> Probe:
        if self.probe not in PROBES and not (self.probe.startswith("metrics.") and self.probe != "metrics."):
            known = ", ".join(sorted(PROBES))
            raise ValueError(f"unknown probe {self.probe!r}; expected one of {known}, or metrics.<key>")
        given = [name for name in ("eq", "lte", "gte", "range", "is_") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"probe {self.probe!r} needs exactly one tolerance of eq, lte, gte, range, is; "
                f"got {len(given)}"
            )
        if self.range is not None and self.range[0] > self.range[1]:
            raise ValueError(f"range must be [low, high] with low <= high, got {list(self.range)}")
        return self

    def describe(self) -> str:
        """The tolerance in words, for reports: ``<= 2.0``, ``in [1, 3]``, ``is true``."""
        if self.eq is not None:
            return f"== {self.eq!r}"
        if self.lte is not None:
            return f"<= {self.lte:g}"
        if self.gte is not None:
            return f">= {self.gte:g}"
        if self.range is not None:
            return f"in [{self.range[0]:g}, {self.range[1]:g}]"
        return f"is {str(self.is_).lower()}"

    def holds(self, observed: Any) -> bool:
        """Whether ``observed`` meets the tolerance."""
        if self.eq is not None:
            return bool(observed == self.eq)
        if self.is_ is not None:
            return observed is self.is_
        if not isinstance(observed, int | float) or isinstance(observed, bool):
            return False
        if self.lte is not None:
            return observed <= self.lte
        if self.gte is not None:
            return observed >= self.gte
        low, high = self.range or (0.0, 0.0)
        return low <= observed <= high


class Scenario(_Model):
    """One chaos scenario: run ``batch`` on ``engine`` with ``runner`` settings (RunnerConfig fields),
    fault-free and then with ``faults``, and check ``expect`` and ``probes``.

    ``pipeline`` names a user's rollout function (``module:function``) to run instead of BatchRunner:
    ``async def fn(tasks, env_factory, engine) -> list[Trajectory | StepWiseTrajectory] | BatchOutput``.
    """

    title: str
    description: str = ""
    tags: list[str] = []
    seed: int = 0
    batch: BatchSpec = BatchSpec()
    engine: EngineSpec = EngineSpec()
    runner: dict[str, Any] = {}
    pipeline: str | None = None
    faults: list[Fault] = []
    expect: Expect = Expect()
    probes: list[Probe] = []

    # A field validator, not a model validator, so that the error names the field: ``pipeline``.
    @field_validator("pipeline")
    @classmethod
    def _pipeline_is_an_import_path(cls, pipeline: str | None) -> str | None:
        if pipeline is not None:
            module, _, function = pipeline.partition(":")
            if not module or not function:
                raise ValueError(f"pipeline must be 'module:function', got {pipeline!r}")
        return pipeline
