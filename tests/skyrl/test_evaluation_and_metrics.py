"""SkyRL 0.3.0's evaluation over several batches, and its aggregation of our metrics, read our output as
its own: nothing crashes and no metric comes out wrong."""

from __future__ import annotations

from typing import Any

from skyrl.train.config import SkyRLTrainConfig
from skyrl.train.evaluate import evaluate
from skyrl.train.generators.base import TrajectoryID
from skyrl.train.generators.utils import concatenate_generator_outputs
from skyrl_client import ScriptedClient, generator_config, gym_config
from trainer_step import FLAKY

from gym_resilience import BatchResult, BatchRunner, RunnerConfig, Task
from gym_resilience.adapters.skyrl import ResilientSkyRLGenerator
from gym_resilience.adapters.skyrl_gym import skyrl_gym_factory
from gym_resilience.engines.scripted import ScriptedEngine


def eval_batches(n_batches: int = 2, per_batch: int = 3) -> list[list[dict[str, Any]]]:
    """What SkyRL's eval dataloader yields: rows of prompt, env class, env extras and uid."""
    return [
        [
            {
                "prompt": [{"role": "user", "content": f"What is 40 + {b}{p}? End with '#### <n>'."}],
                "env_class": FLAKY,
                "env_extras": {"reward_spec": {"ground_truth": "42"}, "fail": p == 1, "data_source": "d"},
                "uid": f"b{b}p{p}",
            }
            for p in range(per_batch)
        ]
        for b in range(n_batches)
    ]


async def test_skyrls_evaluate_runs_over_batches_with_placeholders(tokenizer: Any, tmp_path: Any) -> None:
    generator = ResilientSkyRLGenerator(
        generator_cfg=generator_config(max_turns=2),
        skyrl_gym_cfg=gym_config(),
        inference_engine_client=ScriptedClient(tokenizer),
        tokenizer=tokenizer,
        resilience={"skip_failed_rollouts": True},
    )
    cfg = SkyRLTrainConfig()
    cfg.generator = generator.generator_cfg
    cfg.generator.eval_n_samples_per_prompt = 2
    cfg.trainer.export_path = str(tmp_path)
    metrics = await evaluate(eval_batches(), generator, cfg, global_step=1, tokenizer=tokenizer)
    assert any(key.endswith("avg_score") for key in metrics)
    assert all(value == value for value in metrics.values() if isinstance(value, float))  # no NaN


async def batch_result(n_tasks: int, failing: set[int]) -> BatchResult:
    tasks = [
        Task(
            prompt=[{"role": "user", "content": f"q{i}"}],
            instance_id=f"t{i}",
            env_kwargs={"reward_spec": {"ground_truth": "42"}, "max_turns": 2, "fail": i in failing},
        )
        for i in range(n_tasks)
    ]
    config = RunnerConfig(skip_failed_rollouts=True, max_turns=2, max_tokens=8, n_samples_per_prompt=2)
    return await BatchRunner(ScriptedEngine(), skyrl_gym_factory(FLAKY), config).generate(tasks)


async def test_to_dict_gives_the_installed_releases_keys_ids_and_metric_names() -> None:
    result = await batch_result(3, {1})
    exported = result.output.to_dict()
    assert "trajectory_time_splits" not in exported  # SkyRL 0.3.0 has no such key
    assert all(type(tid) is TrajectoryID for tid in exported["trajectory_ids"])
    assert exported["trajectory_ids"][0] == TrajectoryID(instance_id="t0", repetition_id=0)
    metrics = exported["rollout_metrics"]
    assert "generate/trajectory_completion_time_mean" in metrics
    assert not any(key.startswith("generate/trajectory_time_") for key in metrics)
    assert "rollout_error_rate" not in metrics and "e2e_time/median" not in metrics


async def test_skyrls_concatenation_of_batches_sums_our_counters_and_recomputes_its_own() -> None:
    first, second = await batch_result(3, {1}), await batch_result(2, {0})
    merged = concatenate_generator_outputs([first.output.to_dict(), second.output.to_dict()])
    metrics = merged["rollout_metrics"]
    assert metrics["rollout_errors"] == 4  # 2 failed rollouts in each batch
    assert metrics["rollout_errors/cause/ConnectionError"] == 4
    for key, value in metrics.items():
        if key.startswith("rollout_errors"):
            assert value == first.metrics.get(key, 0) + second.metrics.get(key, 0), key
