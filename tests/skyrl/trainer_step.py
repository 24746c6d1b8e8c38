"""SkyRL 0.3.0's trainer step on a generator's output, through its own methods: ``RayPPOTrainer.generate``
(``validate_generator_output``), ``postprocess_generator_output``, ``convert_to_training_input`` and
``compute_advantages_and_returns``, on a trainer object that has what those methods read (its config,
metrics, tokenizer, generator and a one-rank dispatch) and no Ray workers."""

from __future__ import annotations

import types
from typing import Any

import skyrl_gym
from skyrl.train.config import SkyRLTrainConfig
from skyrl.train.trainer import RayPPOTrainer
from skyrl_gym.envs.gsm8k.multi_turn_env import GSM8kMultiTurnEnv

FLAKY = "flaky_gsm8k_multi_turn"


class FlakyEnv(GSM8kMultiTurnEnv):
    """gsm8k_multi_turn whose ``step`` raises ``ConnectionError`` when its extras say ``fail``."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        extras = extras or {}
        super().__init__(env_config, extras)
        self.fail = bool(extras.get("fail"))

    def step(self, action: str) -> Any:
        if self.fail:
            raise ConnectionError("the sandbox dropped the connection")
        return super().step(action)


if FLAKY not in skyrl_gym.registry:
    skyrl_gym.register(id=FLAKY, entry_point=FlakyEnv)


def trainer(generator: Any, tokenizer: Any, *, merge: bool = False, norm_by_std: bool = True) -> Any:
    """A ``RayPPOTrainer`` for 4 prompts x 2 samples, GRPO, without Ray: its methods run unchanged."""
    cfg = SkyRLTrainConfig()
    cfg.generator = generator.generator_cfg
    cfg.generator.n_samples_per_prompt = 2
    cfg.generator.merge_stepwise_output = merge
    cfg.trainer.train_batch_size = 4
    cfg.trainer.policy_mini_batch_size = 4
    cfg.trainer.algorithm.grpo_norm_by_std = norm_by_std
    ppo = object.__new__(RayPPOTrainer)
    ppo.cfg, ppo.generator, ppo.tokenizer, ppo.all_metrics = cfg, generator, tokenizer, {}
    ppo.dispatch = types.SimpleNamespace(get_lcm_dp_size=lambda: 1)
    return ppo


async def train_step(ppo: Any, batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """SkyRL's step from generation to advantages; the generator output (post-processed) and the batch."""
    output = await ppo.generate(batch)
    uids = [tid.instance_id for tid in batch["trajectory_ids"]]
    if ppo.cfg.generator.step_wise_trajectories:
        uids = [tid.instance_id for tid in output["trajectory_ids"]]
    output, uids = ppo.postprocess_generator_output(output, uids)
    data = ppo.convert_to_training_input(output, uids)
    data["values"] = None
    return output, ppo.compute_advantages_and_returns(data)
