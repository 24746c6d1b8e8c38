"""On fault-free batches ResilientSkyRLGenerator returns what SkyRL 0.3.0's SkyRLGymGenerator returns,
key by key, given the same client: single-turn, multi-turn with truncated turns, and step-wise."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from skyrl.train.generators.base import GeneratorInterface
from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
from skyrl_client import ScriptedClient, generator_config, generator_input, gym_config

from gym_resilience.adapters.skyrl import ResilientSkyRLGenerator

TIMING = ("trajectory_generation_times",)


def build(cls: Any, client: ScriptedClient, tokenizer: Any, **cfg: Any) -> Any:
    """As SkyRL's ``BasePPOExp.get_generator`` builds its generator."""
    return cls(
        generator_cfg=generator_config(**cfg),
        skyrl_gym_cfg=gym_config(),
        inference_engine_client=client,
        tokenizer=tokenizer,
        policy_model_name="tiny",
    )


async def both(tokenizer: Any, env_class: str, **cfg: Any) -> tuple[dict[str, Any], dict[str, Any], Any]:
    batch = generator_input(env_class=env_class)
    skyrl_client, our_client = ScriptedClient(tokenizer), ScriptedClient(tokenizer)
    theirs = await build(SkyRLGymGenerator, skyrl_client, tokenizer, **cfg).generate(copy.deepcopy(batch))
    ours = await build(ResilientSkyRLGenerator, our_client, tokenizer, **cfg).generate(copy.deepcopy(batch))
    return theirs, ours, (skyrl_client, our_client)


def assert_same(theirs: dict[str, Any], ours: dict[str, Any]) -> None:
    assert list(ours) == list(theirs)
    for key in theirs:
        if key in TIMING:
            assert (ours[key] is None) == (theirs[key] is None), key
            assert ours[key] is None or len(ours[key]) == len(theirs[key])
        elif key == "rollout_logprobs" and theirs[key] is not None:
            assert len(ours[key]) == len(theirs[key])
            for mine, their in zip(ours[key], theirs[key], strict=True):
                assert mine == pytest.approx(their, abs=1e-3)
        elif key == "rollout_metrics":
            timing = [k for k in theirs[key] if "time" in k]
            assert sorted(ours[key]) == sorted(theirs[key])
            assert {k: v for k, v in ours[key].items() if k not in timing} == {
                k: v for k, v in theirs[key].items() if k not in timing
            }
        else:
            assert ours[key] == theirs[key], key


@pytest.mark.parametrize(
    ("mode", "env_class", "cfg"),
    [
        ("single-turn", "gsm8k", {"max_turns": 1}),
        ("multi-turn", "gsm8k_multi_turn", {"max_turns": 3}),
        ("step-wise", "gsm8k_multi_turn", {"max_turns": 3, "step_wise": True}),
    ],
)
async def test_a_fault_free_batch_equals_skyrls_generator_key_by_key(
    tokenizer: Any, mode: str, env_class: str, cfg: dict[str, Any]
) -> None:
    theirs, ours, (skyrl_client, our_client) = await both(tokenizer, env_class, **cfg)
    assert_same(theirs, ours)
    # The same requests reached the engine, with the same sessions, and every session was finished.
    assert [c["input"]["session_ids"] for c in our_client.calls] != []
    assert sorted(map(str, (c["input"]["prompt_token_ids"] for c in our_client.calls))) == sorted(
        map(str, (c["input"]["prompt_token_ids"] for c in skyrl_client.calls))
    )
    assert sorted(our_client.finished) == sorted(skyrl_client.finished)


async def test_the_multi_turn_batch_holds_truncated_turns_and_rollouts_of_several_turns(
    tokenizer: Any,
) -> None:
    _, ours, (_, client) = await both(tokenizer, "gsm8k_multi_turn", max_turns=3)
    runs = [sum(1 for a, b in zip([0, *m], m, strict=False) if b and not a) for m in ours["loss_masks"]]
    assert max(runs) > 1
    # A turn cut at max_tokens that the rollout goes on after: its session has a later call.
    sessions = [(call["input"]["session_ids"][0], call["reasons"][0]) for call in client.calls]
    cut_then_on = [
        i
        for i, (session, reason) in enumerate(sessions)
        if reason == "length" and session in dict(sessions[i + 1 :])
    ]
    assert cut_then_on


def test_the_generator_is_a_skyrl_generator_interface(tokenizer: Any) -> None:
    generator = build(ResilientSkyRLGenerator, ScriptedClient(tokenizer), tokenizer)
    assert isinstance(generator, GeneratorInterface)
    assert issubclass(ResilientSkyRLGenerator, GeneratorInterface)


async def test_the_closed_layout_is_an_option_that_ends_each_truncated_turn_with_its_eos(
    tokenizer: Any,
) -> None:
    batch = generator_input(env_class="gsm8k_multi_turn")
    skyrl = await build(SkyRLGymGenerator, ScriptedClient(tokenizer), tokenizer, max_turns=3).generate(
        copy.deepcopy(batch)
    )
    closed = ResilientSkyRLGenerator(
        generator_cfg=generator_config(max_turns=3),
        skyrl_gym_cfg=gym_config(),
        inference_engine_client=ScriptedClient(tokenizer),
        tokenizer=tokenizer,
        token_layout="closed",
    )
    ours = await closed.generate(copy.deepcopy(batch))
    differ = [
        row
        for row, (a, b) in enumerate(zip(ours["response_ids"], skyrl["response_ids"], strict=True))
        if a != b
    ]
    assert differ
    eos = tokenizer.eos_token_id
    for row in differ:  # where they part: our eos, loss-masked, after a turn cut at max_tokens
        mine, theirs = ours["response_ids"][row], skyrl["response_ids"][row]
        at = next(i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b)
        assert mine[at] == eos != theirs[at]
        assert ours["loss_masks"][row][at] == 0
        assert ours["loss_masks"][row][at - 1] == 1 and mine[at - 1] != eos
