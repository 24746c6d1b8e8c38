"""SkyRL 0.3.0's trainer functions on ResilientSkyRLGenerator's output, in every mode, with and without
placeholders: dynamic sampling, the zero-variance filter, step-wise merging, its reward metrics, the
concatenation of batches, step-wise evaluation and its trajectory logger. Placeholders (and groups
``mask_group`` masked) must neither crash them nor bias what they decide."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from skyrl.train.config import SkyRLTrainConfig
from skyrl.train.evaluate import evaluate, evaluate_step_wise
from skyrl.train.generators.base import TrajectoryID
from skyrl.train.generators.utils import concatenate_generator_outputs, get_metrics_from_generator_output
from skyrl.train.utils import trainer_utils
from skyrl.train.utils.trajectory_logging import TrajectoryLogger
from skyrl_client import ScriptedClient, generator_config, generator_input, gym_config
from test_evaluation_and_metrics import eval_batches
from trainer_step import FLAKY, train_step, trainer

from gym_resilience.adapters.skyrl import ResilientSkyRLGenerator

MODES = {
    "single-turn": {"max_turns": 1},
    "multi-turn": {"max_turns": 3},
    "step-wise": {"max_turns": 3, "step_wise": True},
}
FAILING_ROWS = (1, 4, 5)  # q0's second sample, both samples of q2


def generator(tokenizer: Any, policy: str = "keep", **cfg: Any) -> Any:
    return ResilientSkyRLGenerator(
        generator_cfg=generator_config(**cfg),
        skyrl_gym_cfg=gym_config(),
        inference_engine_client=ScriptedClient(tokenizer),
        tokenizer=tokenizer,
        policy_model_name="tiny",
        resilience={"skip_failed_rollouts": True, "failed_group_policy": policy},
    )


def batch(faults: bool, prompts: int = 4) -> dict[str, Any]:
    out = generator_input(n_prompts=prompts, env_class=FLAKY)
    for row in FAILING_ROWS if faults else ():
        out["env_extras"][row]["fail"] = True
    return out


async def generate(
    tokenizer: Any, mode: str, faults: bool, policy: str = "keep"
) -> tuple[Any, Any, list[str]]:
    """The generator, its output and the output's uids (per row, step-wise per step)."""
    gen = generator(tokenizer, policy, **MODES[mode])
    given = batch(faults)
    output = await gen.generate(given)
    ids = output["trajectory_ids"] if output["trajectory_ids"] is not None else given["trajectory_ids"]
    return gen, output, [tid.instance_id for tid in ids]


def sequence_rewards(output: dict[str, Any]) -> list[float]:
    return [float(sum(r)) if isinstance(r, list) else float(r) for r in output["rewards"]]


def placeholder_rows(output: dict[str, Any]) -> list[int]:
    return [row for row, reason in enumerate(output["stop_reasons"]) if reason == "rollout_error"]


both_faults = pytest.mark.parametrize("faults", [False, True], ids=["fault-free", "3 of 8 envs fail"])
every_mode = pytest.mark.parametrize("mode", list(MODES))


@every_mode
@both_faults
@pytest.mark.parametrize("kind", ["filter", "replace"])
async def test_skyrls_dynamic_sampling_takes_the_output(
    tokenizer: Any, mode: str, faults: bool, kind: str
) -> None:
    gen, output, uids = await generate(tokenizer, mode, faults)
    ppo = trainer(gen, tokenizer)
    ppo.cfg.trainer.algorithm.dynamic_sampling.type = kind
    ppo.cfg.trainer.algorithm.dynamic_sampling.min_replace_ratio = 0.0
    ppo.dynamic_sampling_state = None
    rows = len(output["response_ids"])
    processed, kept_uids, keep_sampling = ppo.handle_dynamic_sampling(copy.deepcopy(output), list(uids))
    assert isinstance(keep_sampling, bool)
    assert len(processed["response_ids"]) == len(kept_uids) <= rows
    assert len(processed["loss_masks"]) == len(processed["rewards"]) == len(kept_uids)


def filter_kept_uids(output: dict[str, Any], uids: list[str]) -> set[str]:
    """The groups SkyRL's ``filter`` dynamic sampling keeps from one batch."""
    state: dict[str, Any] = {"sample_batch_count": 1}
    config = {"train_batch_size": 100, "n_samples_per_prompt": 2}
    trainer_utils.handle_filter_sampling(copy.deepcopy(output), list(uids), config, state)
    return set(state["collected_uids"])


async def test_dynamic_sampling_keeps_a_group_for_a_placeholders_variance_under_keep_only(
    tokenizer: Any,
) -> None:
    _, kept, uids = await generate(tokenizer, "multi-turn", True, "keep")
    _, masked, masked_uids = await generate(tokenizer, "multi-turn", True, "mask_group")
    # q0: its real sample scored, its placeholder 0.0. keep: kept for that made-up spread; mask_group: not.
    assert sequence_rewards(kept)[0] > 0
    assert "q0" in filter_kept_uids(kept, uids)
    assert not {"q0", "q2"} & filter_kept_uids(masked, masked_uids)
    # replace: under keep, q0 is a "good" group whose rows are copied over the groups without variance;
    # under mask_group no group of this batch has real spread, so SkyRL asks for another batch.
    sampling = {"n_samples_per_prompt": 2, "min_replace_ratio": 0.0}
    replace = trainer_utils.handle_replace_sampling
    _, replaced_uids, again = replace(copy.deepcopy(kept), list(uids), sampling)
    assert not again and replaced_uids.count("q0") > 2
    _, _, again = replace(copy.deepcopy(masked), list(masked_uids), sampling)
    assert again


@every_mode
@both_faults
async def test_the_zero_variance_filter_decides_the_real_rows_as_without_the_placeholders(
    tokenizer: Any, mode: str, faults: bool
) -> None:
    _, output, uids = await generate(tokenizer, mode, faults)
    rewards, masks = sequence_rewards(output), output["loss_masks"]
    placeholders = set(placeholder_rows(output))
    assert len(placeholders) == (len(FAILING_ROWS) if faults else 0)
    assert all(sum(masks[row]) == 0 for row in placeholders)
    kept = set(trainer_utils.zero_variance_filter(rewards, uids, loss_masks=masks))
    real = [row for row in range(len(rewards)) if row not in placeholders]
    without = trainer_utils.zero_variance_filter(
        [rewards[r] for r in real], [uids[r] for r in real], loss_masks=[masks[r] for r in real]
    )
    assert {row for row in kept if row not in placeholders} == {real[i] for i in without}


@every_mode
@both_faults
async def test_skyrls_reward_metrics_read_the_output_as_its_rows_say(
    tokenizer: Any, mode: str, faults: bool
) -> None:
    _, output, uids = await generate(tokenizer, mode, faults)
    metrics = get_metrics_from_generator_output(output, uids)
    rewards = sequence_rewards(output)
    assert metrics["avg_score"] == pytest.approx(float(np.mean(rewards)))
    passed = {uid for uid, reward in zip(uids, output["rewards"], strict=True) if reward[-1] > 0}
    assert metrics["pass_at_n"] == pytest.approx(len(passed) / len(set(uids)))


@pytest.mark.parametrize("merge", [False, True], ids=["steps", "merged"])
@both_faults
async def test_step_wise_postprocessing_keeps_placeholders_without_loss(
    tokenizer: Any, merge: bool, faults: bool
) -> None:
    gen = generator(tokenizer, **MODES["step-wise"])
    ppo = trainer(gen, tokenizer, merge=merge)
    output, data = await train_step(ppo, batch(faults))
    placeholders = placeholder_rows(output)
    assert len(placeholders) == (len(FAILING_ROWS) if faults else 0)
    for row in placeholders:
        assert (data["loss_mask"][row] == 0).all()
    if merge:
        assert (
            ppo.all_metrics["generate/num_seq_after_merge"]
            <= ppo.all_metrics["generate/num_seq_before_merge"]
        )
    assert torch.isfinite(data["advantages"]).all()


@every_mode
@pytest.mark.parametrize("policy", ["keep", "mask_group"])
async def test_skyrls_concatenation_sums_our_counters_over_batches(
    tokenizer: Any, mode: str, policy: str
) -> None:
    gen = generator(tokenizer, policy, **MODES[mode])
    outputs = []
    for index, faults in enumerate((True, False, True)):
        given = batch(faults)  # each batch its own prompts, as step-wise concatenation requires
        given["trajectory_ids"] = [
            TrajectoryID(instance_id=f"b{index}{tid.instance_id}", repetition_id=tid.repetition_id)
            for tid in given["trajectory_ids"]
        ]
        outputs.append(await gen.generate(given))
    merged = concatenate_generator_outputs(outputs, step_wise=mode == "step-wise")
    metrics = merged["rollout_metrics"]
    assert metrics["rollout_errors"] == 2 * len(FAILING_ROWS)
    assert metrics["rollout_errors/cause/ConnectionError"] == 2 * len(FAILING_ROWS)
    ours = {key for output in outputs for key in output["rollout_metrics"] if key.startswith("rollout_")}
    for key in ours:
        assert metrics[key] == sum(output["rollout_metrics"].get(key, 0) for output in outputs), key
    if policy == "mask_group":
        assert metrics["rollout_groups_masked"] == 4  # q0 and q2, in two batches
    assert len(merged["response_ids"]) == sum(len(o["response_ids"]) for o in outputs)


class _Tracker:
    """What SkyRL's ``TrajectoryLogger`` writes to: a wandb ``Tracking``'s sample table."""

    backend = "wandb"

    def __init__(self) -> None:
        self.tables: list[dict[str, Any]] = []

    def log_samples_to_table(self, **table: Any) -> None:
        self.tables.append(table)


@pytest.mark.parametrize("mode", ["multi-turn", "step-wise"])
async def test_skyrls_evaluation_and_trajectory_logger_run_over_batches_with_placeholders(
    tokenizer: Any, mode: str, tmp_path: Any
) -> None:
    gen = generator(tokenizer, **{**MODES[mode], "max_turns": 2})
    cfg = SkyRLTrainConfig()
    cfg.generator = gen.generator_cfg
    cfg.generator.eval_n_samples_per_prompt = 2
    cfg.trainer.export_path = str(tmp_path)
    cfg.trainer.num_logger_eval_samples = 12
    tracker = _Tracker()
    run = evaluate_step_wise if mode == "step-wise" else evaluate
    metrics = await run(
        eval_batches(),
        gen,
        cfg,
        global_step=1,
        tokenizer=tokenizer,
        trajectory_logger=TrajectoryLogger(),
        tracker=tracker,
    )
    assert 0.0 <= metrics["eval/all/avg_score"] <= 1.0
    assert all(value == value for value in metrics.values() if isinstance(value, float))  # no NaN
    (table,) = tracker.tables
    assert len(table["samples"]) == 12  # 2 batches x 3 prompts x 2 samples, placeholders among them
    assert gen.last_result.metrics["rollout_errors"] == 2  # each batch's failing prompt, both samples
