"""The typed form of a chaos scenario file: what to run, which faults, what must hold.

Models are frozen and reject unknown fields, so a typo in a scenario file is an error, not a silently
ignored key. They check what a value alone shows; what needs imports, files or other fields (a user's
env factory, a model folder, a fault that fits its engine) is checked when the scenario is compiled
(``harness.scenario.compile``, ``harness.scenario.rules``). Loading (YAML, line numbers, every
problem) lives in
``harness.scenario.loader``.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any, Final, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from harness.scenario.messages import did_you_mean, show, split_import_path
from harness.scenario.probe_names import METRICS_PREFIX, PROBE_NAMES, is_probe

__all__ = [
    "BUNDLED_ENVS",
    "MAX_DELAY_S",
    "MAX_TASKS",
    "PROBE_NAMES",
    "BatchSpec",
    "ClusterSpec",
    "ConnectionTargeting",
    "EngineFault",
    "EngineSpec",
    "EnvFault",
    "Expect",
    "Fault",
    "NetworkFault",
    "Probe",
    "RayFault",
    "Scenario",
    "Targeting",
]


BUNDLED_ENVS: Final = ("word_game", "tool_use")
"""The envs gym_resilience bundles, by the names ``batch.env`` gives them."""

MAX_TASKS: Final = 512
"""The most tasks the bundled generator makes for one batch."""

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


class RayFault(_Model):
    """A fault in the Ray cluster the envs run on (``runner.env_backend: ray``): ``kill_actor`` SIGKILLs
    the env actor of the targeted step from inside it, mid-step; ``kill_node`` removes worker node
    ``node`` (None: the one hosting the most env actors) once ``after_steps`` env steps have ended.
    """

    target: Literal["ray"]
    kind: Literal["kill_actor", "kill_node"]
    after_steps: Annotated[int, Field(ge=0)] = 0
    node: Annotated[int, Field(ge=0)] | None = None
    when: Targeting = Targeting()


Fault = Annotated[EnvFault | EngineFault | NetworkFault | RayFault, Field(discriminator="target")]


def _loopback_url(url: str) -> str:
    """``url`` if it is ``http://`` on a loopback address with a port, and nothing after the port: the
    harness sends network traffic only to this machine, and adds each route (``/v1/completions``,
    ``/health``) to the server's base URL itself."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port, parts = None, None, None
    if parts is None or parts.scheme != "http" or host is None or port is None:
        raise ValueError(f"expected an http://HOST:PORT URL, got {show(url)}")
    if host != "localhost" and not _is_loopback_address(host):
        raise ValueError(
            f"endpoint {url!r} is not on loopback: the harness sends network traffic only to this machine "
            "(127.0.0.1, ::1, localhost); run the server here, or forward a loopback port to it"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        base = f"http://{parts.netloc}"
        raise ValueError(
            f"endpoint {url!r} is not a server's base URL: drop {url[len(base) :]!r} and give {base} (the "
            "harness adds /v1/completions, /health and the other routes itself)"
        )
    return url.rstrip("/")


def _is_loopback_address(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class EngineSpec(_Model):
    """The engine: in-process vLLM, ``servers`` vLLM OpenAI servers the harness starts, or OpenAI-compatible
    ``endpoints`` the user already runs on loopback; the last two behind ``OpenAIEngine``."""

    kind: Literal["vllm", "served", "openai"] = "vllm"
    servers: Annotated[int, Field(ge=1, le=4)] = 1
    endpoints: list[Annotated[str, AfterValidator(_loopback_url)]] | None = None
    max_model_len: Annotated[int, Field(ge=64)] = 512

    @property
    def proxied_endpoints(self) -> int:
        """How many endpoints an engine-link fault proxy can sit in front of (0: in-process)."""
        if self.kind == "served":
            return self.servers
        return len(self.endpoints or []) if self.kind == "openai" else 0


class ClusterSpec(_Model):
    """A local multi-node Ray cluster the harness starts for the scenario (and stops after it): ``nodes``
    nodes in all, the head and ``nodes - 1`` worker nodes, each with ``cpus_per_node`` CPUs.
    ``envs_on_worker`` pins every env actor to that worker node (node affinity), off the head, where
    the driver runs."""

    nodes: Annotated[int, Field(gt=1, le=4)]
    cpus_per_node: Annotated[int, Field(ge=1, le=64)] = 1
    envs_on_worker: Annotated[int, Field(ge=0)] | None = None

    @property
    def worker_nodes(self) -> int:
        """How many worker nodes (the nodes but the head)."""
        return self.nodes - 1


class BatchSpec(_Model):
    """The batch: its env and its tasks.

    ``env`` is a bundled env's name or a user's env factory, ``module:name``. ``tasks`` is a count for
    the bundled generator (seeded by ``seed``), a user's task loader (``module:name``), or a ``.jsonl``
    file of tasks (relative to the scenario file).
    """

    env: str = "word_game"
    tasks: int | str = 8
    seed: int | None = None

    @field_validator("env")
    @classmethod
    def _bundled_or_import_path(cls, env: str) -> str:
        if env in BUNDLED_ENVS:
            return env
        if ":" not in env:
            raise ValueError(
                f"unknown env {env!r}: expected word_game, tool_use, or an env factory 'module:name'"
                + did_you_mean(env, BUNDLED_ENVS)
            )
        split_import_path(env, "an env factory")
        return env

    @field_validator("tasks", mode="before")
    @classmethod
    def _count_loader_or_file(cls, tasks: Any) -> Any:
        expected = (
            f"expected a number of tasks in [1, {MAX_TASKS}], a task loader 'module:name', or a .jsonl file"
        )
        if isinstance(tasks, bool) or not isinstance(tasks, int | str):
            raise ValueError(f"{expected}, got {show(tasks)}")
        if isinstance(tasks, int) and not 1 <= tasks <= MAX_TASKS:
            raise ValueError(f"{expected}, got {tasks}")
        if isinstance(tasks, str) and not tasks.endswith(".jsonl"):
            if ":" not in tasks:
                raise ValueError(f"{expected}, got {show(tasks)}")
            split_import_path(tasks, "a task loader")
        return tasks

    @property
    def bundled_env(self) -> Literal["word_game", "tool_use"] | None:
        """The bundled env's name, or None for a user's env factory."""
        if self.env == "word_game":
            return "word_game"
        return "tool_use" if self.env == "tool_use" else None


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
        if self.probe == METRICS_PREFIX:
            raise ValueError("probe 'metrics.' names no metric: write metrics.<key>, the runner metric's key")
        if not is_probe(self.probe):
            known = ", ".join(sorted(PROBE_NAMES))
            raise ValueError(
                f"unknown probe {self.probe!r}"
                + (did_you_mean(self.probe, PROBE_NAMES) or f"; expected one of {known}, or metrics.<key>")
            )
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
            # In Python True == 1: without this, ``eq: true`` would hold for a count of 1.
            if isinstance(observed, bool) != isinstance(self.eq, bool):
                return False
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
    """One chaos scenario: run ``batch`` on ``engine`` (serving ``model``) with ``runner`` settings
    (RunnerConfig fields), fault-free and then with ``faults``, and check ``expect`` and ``probes``.

    ``cluster`` is a local multi-node Ray cluster the harness starts around both runs, for envs run in
    Ray actors (``runner.env_backend: ray``) and the ``ray`` faults.

    ``pipeline`` names a user's rollout function (``module:name``) to run instead of BatchRunner:
    ``async def fn(tasks, env_factory, engine) -> list[Trajectory | StepWiseTrajectory] | BatchOutput``.
    ``model`` is a Hugging Face model folder (relative to the scenario file); None is the bundled tiny
    model. ``python_path`` lists more folders (relative to the scenario file) to import the user's
    modules from, after the scenario's own folder.
    """

    title: str
    description: str = ""
    tags: list[str] = []
    seed: int = 0
    batch: BatchSpec = BatchSpec()
    engine: EngineSpec = EngineSpec()
    model: str | None = None
    python_path: list[str] = []
    runner: dict[str, Any] = {}
    cluster: ClusterSpec | None = None
    pipeline: str | None = None
    faults: list[Fault] = []
    expect: Expect = Expect()
    probes: list[Probe] = []

    # A field validator, not a model validator, so that the error names the field: ``pipeline``.
    @field_validator("pipeline")
    @classmethod
    def _pipeline_is_an_import_path(cls, pipeline: str | None) -> str | None:
        if pipeline is not None:
            split_import_path(pipeline, "pipeline")
        return pipeline
