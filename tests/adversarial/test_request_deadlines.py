"""A request deadline bounds the whole request: a server that trickles its answer cannot stretch it.

Real sockets on 127.0.0.1 against a slow-loris server (tests/slowloris.py), which answers one byte every
0.4 s for as long as the client keeps reading: every single read is fast, only the whole is slow. Bounds on
time are generous upper bounds (5 s for a 1 s deadline): without the fix these calls take 20 s and more.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from leaks import no_leaks
from slowloris import SlowLorisServer, Trickle

from gym_resilience.engines.base import Sampling
from gym_resilience.engines.openai import OpenAIEngine
from gym_resilience.engines.vllm_server import VLLMServer
from gym_resilience.errors import EngineDeadError, EngineError

BOUND_S = 5.0
"""Far above the 1 s deadlines below, far below what an unbounded trickle takes."""


def engine(*urls: str) -> OpenAIEngine:
    # The tokenizer is never loaded: these tests send token ids.
    return OpenAIEngine(
        list(urls), tokenizer_dir="unused", request_timeout_s=1, health_timeout_s=1, health_interval_s=None
    )


@pytest.mark.parametrize("trickle", ["body", "headers"])
async def test_a_trickled_completion_ends_at_the_request_deadline_as_an_endpoint_failure(
    trickle: Trickle,
) -> None:
    with no_leaks(), SlowLorisServer(trickle=trickle, slow_paths={"/v1/completions"}) as server:
        async with engine(server.url) as client:
            start = time.monotonic()
            with pytest.raises(EngineDeadError) as info:
                await client.generate([1, 2, 3], Sampling(max_tokens=4))
            elapsed = time.monotonic() - start
            stats = client.stats.endpoints[0]
    assert elapsed < BOUND_S
    assert "no complete answer within 1 s" in str(info.value)
    assert (stats.requests, stats.failures, stats.healthy) == (1, 1, False)


async def test_two_trickling_endpoints_each_fail_at_the_deadline_and_the_request_fails_over_once() -> None:
    with (
        no_leaks(),
        SlowLorisServer(trickle="body", slow_paths={"/v1/completions"}) as first,
        SlowLorisServer(trickle="headers", slow_paths={"/v1/completions"}) as second,
    ):
        async with engine(first.url, second.url) as client:
            start = time.monotonic()
            with pytest.raises(EngineDeadError):
                await client.generate([1, 2, 3], Sampling(max_tokens=4))
            elapsed = time.monotonic() - start
            stats = client.stats
    assert elapsed < 2 * BOUND_S
    assert (stats.requests, stats.failures, stats.failovers) == (2, 2, 1)


@pytest.mark.parametrize("trickle", ["body", "headers"])
async def test_a_trickled_health_probe_ends_at_the_health_deadline_and_the_endpoint_is_out_of_rotation(
    trickle: Trickle,
) -> None:
    with no_leaks(), SlowLorisServer(trickle=trickle, slow_paths={"/health"}) as server:
        client = engine(server.url)
        start = time.monotonic()
        async with client:
            elapsed = time.monotonic() - start
            stats = client.stats.endpoints[0]
    assert elapsed < BOUND_S
    assert not stats.healthy
    assert stats.last_error == "health check: no complete answer within 1 s"


def test_a_server_health_probe_against_a_trickled_status_line_says_unhealthy_at_its_deadline(
    tmp_path: Path,
) -> None:
    with no_leaks(), SlowLorisServer(trickle="headers") as server:
        start = time.monotonic()
        healthy = VLLMServer(tmp_path, port=server.port).is_healthy(timeout_s=1)
        elapsed = time.monotonic() - start
    assert not healthy
    assert elapsed < BOUND_S


async def test_waiting_for_a_server_whose_health_answer_trickles_ends_at_the_wait_deadline(
    tmp_path: Path,
) -> None:
    with SlowLorisServer(trickle="body") as loris:
        server = VLLMServer(tmp_path, port=loris.port, log_path=tmp_path / "server.log")
        # A real process that stays alive but never serves: the probe meets only the slow-loris server.
        server.command = [sys.executable, "-c", "import time; time.sleep(60)"]
        with server:
            start = time.monotonic()
            with pytest.raises(EngineError, match="did not answer /health"):
                await server.wait_healthy(timeout_s=1, poll_s=0.1)
            elapsed = time.monotonic() - start
    assert elapsed < BOUND_S


@pytest.mark.parametrize("trickle", ["body", "headers"])
def test_a_tool_server_that_trickles_its_answer_cannot_hold_a_tool_env_step_past_its_timeout(
    trickle: str,
) -> None:
    from gym_resilience.envs import ToolUseEnv

    slow = SlowLorisServer(trickle=trickle, slow_paths={"/calculate"}, interval_s=0.2, quick_body=b"[]")  # type: ignore[arg-type]
    with slow as server:
        env = ToolUseEnv(server.url, target=1, timeout=1.0)
        env.reset(seed=0)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="no complete answer within 1 s"):
            env.step("1 + 1")
        assert time.monotonic() - start < 5.0
        env.close()
