"""ResilientSkyRLGenerator inside SkyRL 0.3.0's trainer step with a real vLLM server behind SkyRL's
``InferenceEngineInterface`` (the bundled tiny model, greedy): failing envs cost their rows, not the
step, and on a fault-free batch it sends what SkyRL's ``SkyRLGymGenerator`` sends and gets the same."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_vllm_sampling_params
from skyrl.train.config import SamplingParams
from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
from skyrl_client import DEFAULT_MAX_TOKENS, generator_config, generator_input, gym_config
from trainer_step import FLAKY, train_step, trainer
from vllm_client import VLLMCompletionsClient, start_server

from gym_resilience.adapters.skyrl import ResilientSkyRLGenerator
from gym_resilience.models import build_tiny_model

FAILING_ROWS = (1, 4, 5)
GREEDY = SamplingParams(max_generate_length=DEFAULT_MAX_TOKENS, temperature=0.0, logprobs=1)


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    running = start_server(build_tiny_model())
    try:
        yield running
    finally:
        running.stop()


def client(server: Any) -> VLLMCompletionsClient:
    return VLLMCompletionsClient(server.url, str(server.model_dir))


def greedy_batch(env_class: str, failing: tuple[int, ...] = ()) -> dict[str, Any]:
    """SkyRL's ``GeneratorInput`` with the vLLM sampling params its trainer sends (temperature 0)."""
    batch = generator_input(env_class=env_class, sampling_params=get_vllm_sampling_params(GREEDY))
    for row in failing:
        batch["env_extras"][row]["fail"] = True
    return batch


def build(cls: Any, engine: VLLMCompletionsClient, tokenizer: Any, **cfg: Any) -> Any:
    return cls(
        generator_cfg=generator_config(**cfg),
        skyrl_gym_cfg=gym_config(),
        inference_engine_client=engine,
        tokenizer=tokenizer,
        policy_model_name=engine.model_name,
        **({"resilience": {"skip_failed_rollouts": True}} if cls is not SkyRLGymGenerator else {}),
    )


async def test_skyrls_trainer_step_completes_with_3_of_8_envs_failing_against_real_vllm(
    server: Any, tokenizer: Any
) -> None:
    engine = client(server)
    fault_free, _ = await train_step(
        trainer(build(ResilientSkyRLGenerator, engine, tokenizer, max_turns=2), tokenizer),
        greedy_batch(FLAKY),
    )
    ppo = trainer(build(ResilientSkyRLGenerator, engine, tokenizer, max_turns=2), tokenizer)
    output, data = await train_step(ppo, greedy_batch(FLAKY, FAILING_ROWS))

    assert engine.requests and all(body["temperature"] == 0.0 for body in engine.requests)
    assert [row for row, r in enumerate(output["stop_reasons"]) if r == "rollout_error"] == list(FAILING_ROWS)
    for row in FAILING_ROWS:
        assert output["loss_masks"][row] == [0]
        assert (data["loss_mask"][row] == 0).all()
    # Every other row is the row the fault-free step trained on, token for token.
    for row in sorted(set(range(8)) - set(FAILING_ROWS)):
        for key in ("prompt_token_ids", "response_ids", "loss_masks", "rewards", "stop_reasons"):
            assert output[key][row] == fault_free[key][row], (key, row)
        assert sum(output["loss_masks"][row]) > 0
        logprobs = output["rollout_logprobs"][row]
        assert len(logprobs) == len(output["response_ids"][row]) and all(lp <= 0.0 for lp in logprobs)
    assert torch.isfinite(data["advantages"]).all()
    assert ppo.all_metrics["rollout_errors/cause/ConnectionError"] == len(FAILING_ROWS)


async def test_skyrls_generator_and_ours_send_the_same_prompts_and_get_the_same_greedy_tokens(
    server: Any, tokenizer: Any
) -> None:
    theirs_client, ours_client = client(server), client(server)
    batch = greedy_batch("gsm8k")
    theirs = await build(SkyRLGymGenerator, theirs_client, tokenizer).generate(copy.deepcopy(batch))
    ours = await build(ResilientSkyRLGenerator, ours_client, tokenizer).generate(copy.deepcopy(batch))

    def sent(engine: VLLMCompletionsClient) -> list[str]:
        return sorted(repr(sorted(body.items())) for body in engine.requests)

    assert len(ours_client.requests) == len(theirs_client.requests) == 8
    assert sent(ours_client) == sent(theirs_client)
    for key in ("prompt_token_ids", "response_ids", "loss_masks", "rewards", "stop_reasons", "env_metrics"):
        assert ours[key] == theirs[key], key
    for mine, their in zip(ours["rollout_logprobs"], theirs["rollout_logprobs"], strict=True):
        assert mine == pytest.approx(their, abs=1e-3)
    assert sorted(ours_client.finished) == sorted(theirs_client.finished)
