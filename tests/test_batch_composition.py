"""Does vLLM's greedy output on CPU depend on which other requests share the batch? Measured here.

The chaos harness compares each scenario's faulted run with a fault-free baseline, and the two runs
batch their requests differently. These tests pin down what holds on the bundled float32 tiny model:
the same prompt gives the same greedy tokens alone or in a crowd, and its logprobs agree within the
harness's ``LOGPROB_TOLERANCE`` (they are not bit-identical: batch composition moves them by about
1e-6), which is why ``identical_to_baseline`` compares logprobs with a tolerance and reports a token
chosen at a numerical tie as a tie, not as a deviation.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from gym_resilience.engines import Generation, Sampling
from gym_resilience.engines.vllm import VLLMEngine
from gym_resilience.engines.vllm_args import checkpoint_dtype
from harness.judge.compare import LOGPROB_TOLERANCE

pytestmark = pytest.mark.slow

SAMPLING = Sampling(max_tokens=24, temperature=0.0, logprobs=True)


def prompts(engine: VLLMEngine, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    words = ["left", "right", "tool", "answer", "step", "guess", "word", "seven", "calc", "done"]
    return [engine.tokenizer.encode(" ".join(rng.choices(words, k=rng.randint(3, 40)))) for _ in range(n)]


async def generate_all(engine: VLLMEngine, batch: list[list[int]]) -> list[Generation]:
    return list(await asyncio.gather(*(engine.generate(p, SAMPLING) for p in batch)))


def test_the_tiny_model_is_saved_in_float32_so_vllm_runs_it_in_float32(tiny_model) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    assert checkpoint_dtype(tiny_model) == "float32" == config.get("dtype", config.get("torch_dtype"))


async def test_greedy_tokens_do_not_depend_on_the_batch_and_logprobs_agree_within_the_tolerance(
    vllm_engine,
) -> None:
    probes = prompts(vllm_engine, 8, seed=1)
    crowd = prompts(vllm_engine, 40, seed=2)
    alone = [await vllm_engine.generate(p, SAMPLING) for p in probes]
    together = await generate_all(vllm_engine, probes)
    in_a_crowd = (await generate_all(vllm_engine, crowd[:20] + probes + crowd[20:]))[20:28]
    for batch in (together, in_a_crowd):
        assert [g.token_ids for g in batch] == [g.token_ids for g in alone]
        drift = max(
            abs(a - b)
            for x, y in zip(alone, batch, strict=True)
            for a, b in zip(x.logprobs or [], y.logprobs or [], strict=True)
        )
        assert drift <= LOGPROB_TOLERANCE
