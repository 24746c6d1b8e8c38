"""OpenAIEngine: its failover logic over httpx's MockTransport: endpoints that refuse, reset, fail or
hang, health checks, cancellation and closing mid-request. Its pure parts are in
``tests/engines/test_completions.py``, its runs against real vLLM servers in ``tests/test_openai_servers.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai_payloads import EOS, PROMPT, A, B, completion_json, wait_until

from gym_resilience import RetryPolicy
from gym_resilience.engines import Engine, Sampling
from gym_resilience.engines.completions import (
    completion_request,
)
from gym_resilience.engines.openai import OpenAIEngine, OpenAIEngineStats
from gym_resilience.engines.vllm import VLLMEngine
from gym_resilience.engines.vllm_server import free_ports
from gym_resilience.errors import (
    EngineClosedError,
    EngineDeadError,
    EngineError,
    EngineRequestError,
    UnsupportedConfigError,
)

slow = pytest.mark.slow


# --- Helpers. -----------------------------------------------------------------------------------------


class FakeServers:
    """Endpoints behind a MockTransport. Each one's completions answer, reset the connection or return
    a status; ``"down"`` refuses every connection, health checks included, which otherwise answer 200.
    """

    def __init__(self, **behaviour: str | int) -> None:
        self.behaviour: dict[str, str | int] = {A: "ok", B: "ok", **behaviour}
        self.calls: list[tuple[str, str]] = []

    def set(self, url: str, behaviour: str | int) -> None:
        self.behaviour[url] = behaviour

    async def handle(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}"
        self.calls.append((url, request.url.path))
        behaviour = self.behaviour[url]
        if behaviour == "down":
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        if behaviour == "reset":
            raise httpx.RemoteProtocolError("server disconnected without a response", request=request)
        if isinstance(behaviour, int):
            return httpx.Response(behaviour, json={"error": {"message": f"status {behaviour}"}})
        prompt = json.loads(await request.aread())["prompt"]
        return httpx.Response(200, json=completion_json(prompt, [7, 8, EOS]))

    def posts(self, url: str) -> int:
        return sum(1 for where, path in self.calls if where == url and path == "/v1/completions")


def fake_engine(fake: FakeServers, urls: tuple[str, ...] = (A, B), **kwargs: Any) -> OpenAIEngine:
    kwargs.setdefault("health_interval_s", None)
    return OpenAIEngine(
        list(urls), tokenizer_dir="/unused", transport=httpx.MockTransport(fake.handle), **kwargs
    )


def by_url(stats: OpenAIEngineStats, url: str) -> Any:
    return next(endpoint for endpoint in stats.endpoints if endpoint.url == url)


async def test_a_server_answering_a_nan_logprob_fails_the_request_with_engine_error_naming_it() -> None:
    # A bare NaN, as Python's json.dumps writes one, which httpx's json() reads back as a float.
    choice = b'{"token_ids": [7, 3], "finish_reason": "stop", "logprobs": {"token_logprobs": [-0.5, NaN]}}'
    body = b'{"choices": [' + choice + b"]}"

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(200, content=body, headers={"content-type": "application/json"})

    engine = OpenAIEngine(
        [A], tokenizer_dir="/unused", transport=httpx.MockTransport(handle), health_interval_s=None
    )
    async with engine:
        with pytest.raises(EngineError, match=r"completion has logprob nan for the token at position 1"):
            await engine.generate(PROMPT, Sampling(logprobs=True))
        stats = engine.stats
    assert (stats.requests, stats.failures, stats.endpoints[0].successes) == (1, 0, 0)


def test_bad_endpoint_lists_are_rejected() -> None:
    for urls, message in (([], "at least one"), ([A, A + "/"], "unique"), (A, "one string")):
        with pytest.raises(UnsupportedConfigError, match=message):
            OpenAIEngine(urls, tokenizer_dir="/unused")  # type: ignore[arg-type]


# --- Failover logic over a mock transport. ------------------------------------------------------------


async def test_a_refused_connection_fails_over_and_takes_the_endpoint_out_of_rotation() -> None:
    fake = FakeServers()
    async with fake_engine(fake) as engine:
        fake.set(A, "down")
        generations = [await engine.generate(PROMPT, Sampling(logprobs=True)) for _ in range(4)]
        assert all(g.token_ids == [7, 8, EOS] and g.logprobs == [-0.5] * 3 for g in generations)
        stats = engine.stats
    a, b = by_url(stats, A), by_url(stats, B)
    assert (a.requests, a.failures, a.failovers, a.marked_down, a.healthy) == (1, 1, 1, 1, False)
    assert (b.requests, b.successes, b.failures) == (4, 4, 0)
    assert stats.failovers == 1 and stats.out_of_rotation == (A,) and "ConnectError" in a.last_error
    assert stats.as_metrics()["engine/failovers"] == 1.0
    assert stats.as_metrics()["engine/endpoint0/healthy"] == 0.0


@pytest.mark.parametrize("failure", ["reset", 500, 503])
async def test_a_reset_or_5xx_is_retried_once_on_the_other_endpoint(failure: str | int) -> None:
    fake = FakeServers(**{A: failure})
    async with fake_engine(fake) as engine:
        generations = [await engine.generate(PROMPT, Sampling()) for _ in range(3)]
        stats = engine.stats
    assert all(generation.token_ids == [7, 8, EOS] for generation in generations)
    assert fake.posts(A) == 1 and fake.posts(B) == 3
    assert by_url(stats, A).failovers == 1 and stats.out_of_rotation == (A,)


async def test_a_4xx_is_raised_and_not_retried() -> None:
    fake = FakeServers()
    async with fake_engine(fake) as engine:
        fake.set(A, 400)
        fake.set(B, 400)
        with pytest.raises(EngineRequestError, match=r"rejected the request \(400\): status 400"):
            await engine.generate(PROMPT, Sampling())
        stats = engine.stats
    assert stats.requests == 1 and stats.failures == 0 and stats.failovers == 0
    assert stats.out_of_rotation == () and sum(e.rejected for e in stats.endpoints) == 1


async def test_when_every_endpoint_fails_engine_dead_error_names_them_all() -> None:
    fake = FakeServers()
    async with fake_engine(fake) as engine:
        fake.set(A, "reset")
        fake.set(B, 502)
        with pytest.raises(EngineDeadError) as info:
            await engine.generate(PROMPT, Sampling())
        stats = engine.stats
    message = str(info.value)
    assert message.startswith("no vLLM endpoint could serve the request: ")
    assert f"{A} (RemoteProtocolError" in message and f"{B} (HTTP 502: status 502)" in message
    # The last endpoint's failure, transient: RetryPolicy retries the rollout.
    assert isinstance(info.value.__cause__, ConnectionError) and RetryPolicy().is_retryable(info.value)
    assert stats.failures == 2 and stats.failovers == 1 and set(stats.out_of_rotation) == {A, B}


async def test_endpoints_down_at_start_are_probed_again_before_a_request_gives_up() -> None:
    fake = FakeServers(**{A: "down", B: "down"})
    async with fake_engine(fake) as engine:
        assert set(engine.stats.out_of_rotation) == {A, B}
        with pytest.raises(EngineDeadError, match="health check: ConnectError"):
            await engine.generate(PROMPT, Sampling())
        fake.set(B, "ok")
        assert (await engine.generate(PROMPT, Sampling())).token_ids == [7, 8, EOS]
        stats = engine.stats
    assert stats.out_of_rotation == (A,) and by_url(stats, B).recovered == 1 and stats.requests == 1


async def test_the_health_check_returns_a_recovered_endpoint_to_rotation() -> None:
    fake = FakeServers()
    async with fake_engine(fake, health_interval_s=0.01) as engine:
        fake.set(A, "down")
        await engine.generate(PROMPT, Sampling())
        assert engine.stats.out_of_rotation == (A,)
        fake.set(A, "ok")
        await wait_until(lambda: engine.stats.out_of_rotation == (), what="A back in rotation")
        await asyncio.gather(*(engine.generate(PROMPT, Sampling()) for _ in range(4)))
        stats = engine.stats
    assert by_url(stats, A).recovered == 1 and by_url(stats, A).successes == 2


async def test_cancelling_a_request_frees_its_slot_and_counts_it_as_cancelled() -> None:
    release = asyncio.Event()

    async def hang(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        await release.wait()
        return httpx.Response(200, json=completion_json(PROMPT, [7]))

    engine = OpenAIEngine([A], tokenizer_dir="/unused", transport=httpx.MockTransport(hang))
    async with engine:
        task = asyncio.create_task(engine.generate(PROMPT, Sampling()))
        await wait_until(lambda: engine.num_in_flight == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = engine.stats
    release.set()
    assert engine.num_in_flight == 0 and stats.endpoints[0].cancelled == 1 and stats.failures == 0
    assert stats.out_of_rotation == ()


async def test_generate_outside_async_with_raises_engine_closed_error() -> None:
    engine = fake_engine(FakeServers())
    with pytest.raises(EngineClosedError, match="is new"):
        await engine.generate(PROMPT, Sampling())
    async with engine:
        pass
    await engine.aclose()
    with pytest.raises(EngineClosedError, match="is closed"):
        await engine.generate(PROMPT, Sampling())
    with pytest.raises(EngineClosedError, match="only once"):
        await engine.start()


def test_request_ids_and_numbers_are_plain_ints_and_a_float_is_a_request_error() -> None:
    import numpy

    sampling = Sampling(max_tokens=numpy.int64(4), seed=numpy.int64(5), stop_token_ids=(numpy.int64(3),))
    body = completion_request(numpy.array(PROMPT), sampling, model=None, extra={})
    assert json.loads(json.dumps(body))["prompt"] == PROMPT  # plain ints: they serialize
    assert (body["max_tokens"], body["seed"], body["stop_token_ids"]) == (4, 5, [3])
    with pytest.raises(EngineRequestError, match="the prompt's token ids must be integers"):
        completion_request([1.5, 2.0], Sampling(), model=None, extra={})
    with pytest.raises(EngineRequestError, match="seed must be None or an integer"):
        completion_request(PROMPT, Sampling(seed=1.5), model=None, extra={})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("request_timeout_s", -1.0),
        ("request_timeout_s", math.nan),
        ("connect_timeout_s", 0),
        ("health_timeout_s", None),
    ],
)
def test_a_timeout_that_is_no_deadline_is_rejected_at_construction(option: str, value: Any) -> None:
    with pytest.raises(UnsupportedConfigError) as info:
        OpenAIEngine([A], tokenizer_dir="/unused", **{option: value})
    assert info.value.option == option


@pytest.mark.parametrize("failure", ["reset", 429, 503, 408])
async def test_a_transient_failure_of_the_only_endpoint_is_a_dead_error_retry_policy_retries(
    failure: str | int,
) -> None:
    fake = FakeServers(**{A: failure})
    async with fake_engine(fake, urls=(A,)) as engine:
        with pytest.raises(EngineDeadError) as info:
            await engine.generate(PROMPT, Sampling())
        fake.set(A, "ok")
        assert (await engine.generate(PROMPT, Sampling())).token_ids == [7, 8, EOS]  # back after a probe
    assert isinstance(info.value.__cause__, ConnectionError)
    assert RetryPolicy().is_retryable(info.value)


async def test_a_body_that_does_not_decode_fails_over_like_a_reset() -> None:
    fake = FakeServers()

    async def corrupt_on_a(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a.test" and request.url.path == "/v1/completions":
            return httpx.Response(200, content=b"not gzip", headers={"Content-Encoding": "gzip"})
        return await fake.handle(request)

    engine = OpenAIEngine([A, B], tokenizer_dir="/unused", transport=httpx.MockTransport(corrupt_on_a))
    async with engine:
        generations = [await engine.generate(PROMPT, Sampling()) for _ in range(2)]
        stats = engine.stats
    assert all(generation.token_ids == [7, 8, EOS] for generation in generations)
    assert by_url(stats, A).failures == 1 and stats.failovers == 1


def hanging_health(release: asyncio.Event) -> httpx.MockTransport:
    """Health checks wait for ``release`` (200 then); completions answer."""

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            await release.wait()
            return httpx.Response(200)
        return httpx.Response(200, json=completion_json(PROMPT, [7]))

    return httpx.MockTransport(handle)


def health_tasks() -> list[asyncio.Task[Any]]:
    return [task for task in asyncio.all_tasks() if task.get_name() == "gym-resilience-openai-health"]


async def test_an_engine_closed_while_it_probes_at_start_raises_closed_error_and_leaves_no_task() -> None:
    release = asyncio.Event()
    engine = OpenAIEngine([A], tokenizer_dir="/unused", transport=hanging_health(release))
    starting = asyncio.create_task(engine.start())
    await asyncio.sleep(0.01)
    await engine.aclose()
    release.set()
    with pytest.raises(EngineClosedError, match="closed while it started"):
        await starting
    assert health_tasks() == []


async def test_a_start_cancelled_while_it_probes_closes_what_it_opened() -> None:
    engine = OpenAIEngine([A], tokenizer_dir="/unused", transport=hanging_health(asyncio.Event()))
    starting = asyncio.create_task(engine.start())
    await asyncio.sleep(0.01)
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert engine._client is None and health_tasks() == []
    with pytest.raises(EngineClosedError, match="is closed"):
        await engine.generate(PROMPT, Sampling())


async def test_a_request_whose_engine_closes_while_it_probes_raises_engine_closed_error() -> None:
    """A refuses the completion; B, out of rotation since the start, gets a last-chance probe, which
    hangs until the engine is closed: the close ended the request, not the endpoints."""
    probing, release = asyncio.Event(), asyncio.Event()

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            if request.url.host == "a.test":
                return httpx.Response(200)
            if not probing.is_set():
                probing.set()
                return httpx.Response(503)  # at start: B is out of rotation
            await release.wait()
            return httpx.Response(200)
        raise httpx.ConnectError("connection refused", request=request)

    engine = OpenAIEngine([A, B], tokenizer_dir="/unused", transport=httpx.MockTransport(handle))
    await engine.start()
    request = asyncio.create_task(engine.generate(PROMPT, Sampling()))
    await asyncio.sleep(0.05)
    await engine.aclose()
    release.set()
    with pytest.raises(EngineClosedError):
        await request


async def serve_completions(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A vLLM server's two routes, over real HTTP/1.1: ``/health`` and a one-token completion."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while head := await reader.readuntil(b"\r\n\r\n"):
            path = head.split(b" ")[1].decode()
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ),
                0,
            )
            body = await reader.readexactly(length)
            answer = (
                b""
                if path == "/health"
                else json.dumps(completion_json(json.loads(body)["prompt"], [7])).encode()
            )
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                % len(answer)
                + answer
            )
            await writer.drain()
    writer.close()


@pytest.mark.parametrize("trust_env", [False, True])
async def test_a_proxy_in_the_environment_is_used_only_when_trusted(
    monkeypatch: pytest.MonkeyPatch, trust_env: bool
) -> None:
    """A real server on loopback, and HTTP_PROXY at a loopback port where nothing listens: trusted, the
    proxy takes the requests (and fails them); by default the server gets them."""
    server = await asyncio.start_server(serve_completions, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    (dead_port,) = free_ports(1)
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{dead_port}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    try:
        async with OpenAIEngine(
            [url], tokenizer_dir="/unused", health_interval_s=None, trust_env=trust_env
        ) as engine:
            if trust_env:
                with pytest.raises(EngineDeadError):
                    await engine.generate(PROMPT, Sampling())
            else:
                assert (await engine.generate(PROMPT, Sampling())).token_ids == [7]
    finally:
        server.close()
        await server.wait_closed()


def test_retry_policy_never_retries_a_cancellation_or_an_interrupt_whatever_its_cause() -> None:
    for error in (KeyboardInterrupt(), asyncio.CancelledError()):
        error.__cause__ = ConnectionResetError("reset")
        assert not RetryPolicy().is_retryable(error)
    transient = RuntimeError("failed")
    transient.__cause__ = ConnectionResetError("reset")
    assert RetryPolicy().is_retryable(transient)


@slow
def test_the_engine_satisfies_the_protocol_and_loads_the_tokenizer_as_the_in_process_engine_does(
    tiny_model: Path,
) -> None:
    engine = OpenAIEngine([A], tokenizer_dir=tiny_model)
    assert isinstance(engine, Engine)
    ids = engine.tokenizer.encode("hello world")
    assert ids == VLLMEngine(tiny_model).tokenizer.encode("hello world")
    assert engine.tokenizer.eos_token_id == EOS
