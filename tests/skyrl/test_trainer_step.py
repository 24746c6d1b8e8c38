"""SkyRL 0.3.0's trainer step accepts ResilientSkyRLGenerator's output in every mode, with and without
placeholders: 3 of 8 envs raising ConnectionError cost three rows, not the step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
from skyrl_client import ScriptedClient, generator_config, generator_input, gym_config
from trainer_step import FLAKY, train_step, trainer

from gym_resilience.adapters.skyrl import ResilientSkyRLGenerator

MODES = {
    "single-turn": {"max_turns": 1},
    "multi-turn": {"max_turns": 3},
    "step-wise": {"max_turns": 3, "step_wise": True},
    "step-wise merged": {"max_turns": 3, "step_wise": True},
}
FAILING_ROWS = (1, 4, 5)  # q0's second sample, both samples of q2


def generator(tokenizer: Any, resilience: Any = None, **cfg: Any) -> Any:
    return ResilientSkyRLGenerator(
        generator_cfg=generator_config(**cfg),
        skyrl_gym_cfg=gym_config(),
        inference_engine_client=ScriptedClient(tokenizer),
        tokenizer=tokenizer,
        policy_model_name="tiny",
        resilience=resilience,
    )


def flaky_batch() -> dict[str, Any]:
    batch = generator_input(env_class=FLAKY)
    for row in FAILING_ROWS:
        batch["env_extras"][row]["fail"] = True
    return batch


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("faults", [False, True], ids=["fault-free", "3 of 8 envs fail"])
async def test_skyrls_trainer_step_accepts_the_output(tokenizer: Any, mode: str, faults: bool) -> None:
    gen = generator(tokenizer, {"skip_failed_rollouts": True}, **MODES[mode])
    ppo = trainer(gen, tokenizer, merge=mode.endswith("merged"))
    output, data = await train_step(ppo, flaky_batch() if faults else generator_input(env_class=FLAKY))
    placeholders = output["stop_reasons"].count("rollout_error")
    assert placeholders == (len(FAILING_ROWS) if faults else 0)
    assert torch.isfinite(data["advantages"]).all()
    assert ppo.all_metrics["reward/avg_raw_reward"] >= 0.0
    if faults:
        assert ppo.all_metrics["rollout_errors"] == len(FAILING_ROWS)
        assert ppo.all_metrics["rollout_errors/cause/ConnectionError"] == len(FAILING_ROWS)


async def test_skyrls_own_generator_loses_the_step_to_one_failing_env(tokenizer: Any) -> None:
    gen = SkyRLGymGenerator(
        generator_cfg=generator_config(max_turns=3),
        skyrl_gym_cfg=gym_config(),
        inference_engine_client=ScriptedClient(tokenizer),
        tokenizer=tokenizer,
    )
    with pytest.raises(ConnectionError):
        await train_step(trainer(gen, tokenizer), flaky_batch())


@pytest.mark.parametrize("norm_by_std", [True, False])
async def test_mask_group_leaves_every_row_of_a_failed_group_without_loss(
    tokenizer: Any, norm_by_std: bool
) -> None:
    gen = generator(
        tokenizer, {"skip_failed_rollouts": True, "failed_group_policy": "mask_group"}, max_turns=3
    )
    ppo = trainer(gen, tokenizer, norm_by_std=norm_by_std)
    output, data = await train_step(ppo, flaky_batch())
    # q0 (one sample failed) and q2 (both failed): every row without loss; q1 and q3 keep theirs.
    masked = [sum(mask) == 0 for mask in output["loss_masks"]]
    assert masked == [True, True, False, False, True, True, False, False]
    # SkyRL's GRPO gives the masked groups' rows advantage 0 on every token, not only under the mask.
    assert (data["loss_mask"][[0, 1, 4, 5]] == 0).all()
    assert (data["advantages"][[0, 1, 4, 5]] == 0).all()
    assert (data["loss_mask"][[2, 3, 6, 7]].sum(dim=1) > 0).all()
    assert ppo.all_metrics["rollout_groups_masked"] == 2


def real_sample_advantage(output: dict[str, Any], data: Any, row: int) -> float:
    mask = data["loss_mask"][row].bool()
    return float(data["advantages"][row][mask].mean()) if mask.any() else 0.0


@pytest.mark.parametrize(("norm_by_std", "expected"), [(True, 0.7071), (False, 0.0667)])
async def test_keep_puts_the_placeholders_zero_into_its_groups_grpo_statistics(
    tokenizer: Any, norm_by_std: bool, expected: float
) -> None:
    gen = generator(tokenizer, {"skip_failed_rollouts": True, "failed_group_policy": "keep"}, max_turns=3)
    output, data = await train_step(trainer(gen, tokenizer, norm_by_std=norm_by_std), flaky_batch())
    # q0's real sample scored 0.133 and keeps its loss; its advantage is relative to the placeholder's 0.0
    # (docs/coming-from-skyrl.md's table): (r - r/2) / std([r, 0.0]) = 0.707 for any r > 0, or r/2.
    assert sum(output["rewards"][0]) == pytest.approx(2 * 0.2 / 3)  # two well-formatted wrong answers
    assert sum(output["loss_masks"][0]) > 0
    assert sum(output["loss_masks"][1]) == 0
    assert real_sample_advantage(output, data, 0) == pytest.approx(expected, abs=1e-3)
    # mask_group: the same sample, no loss and advantage 0.
    gen = generator(
        tokenizer, {"skip_failed_rollouts": True, "failed_group_policy": "mask_group"}, max_turns=3
    )
    output, data = await train_step(trainer(gen, tokenizer, norm_by_std=norm_by_std), flaky_batch())
    assert real_sample_advantage(output, data, 0) == 0.0 and (data["advantages"][0] == 0).all()
