"""A drop-in generator for SkyRL's trainer that keeps the step alive when envs or the engine fail.

``ResilientSkyRLGenerator`` is a ``skyrl.train.generators.base.GeneratorInterface`` built with exactly the
arguments SkyRL's ``BasePPOExp.get_generator`` gives ``SkyRLGymGenerator``, plus ``resilience=``. It runs
each batch through ``BatchRunner`` (retries, deadlines, env backends, placeholders for failed rollouts)
against SkyRL's own inference client, and returns the ``GeneratorOutput`` SkyRL's generator would: on a
fault-free batch the same rows, keys and metrics.

Swap it in where SkyRL builds its generator::

    class MyExp(BasePPOExp):
        def get_generator(self, cfg, tokenizer, inference_engine_client):
            return ResilientSkyRLGenerator(
                generator_cfg=cfg.generator,
                skyrl_gym_cfg=cfg.environment.skyrl_gym,
                inference_engine_client=inference_engine_client,
                tokenizer=tokenizer,
                policy_model_name=resolve_policy_model_name(cfg),
                resilience={"skip_failed_rollouts": True, "failed_group_policy": "mask_group"},
            )

This module imports without SkyRL; the class itself (a subclass of SkyRL's ``GeneratorInterface``) is
made on first use, and needs ``skyrl`` and ``skyrl-gym`` installed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gym_resilience.adapters.skyrl_gym import SkyRLGymEnv
from gym_resilience.config import RunnerConfig, TokenLayout
from gym_resilience.engines.base import Generation, Sampling
from gym_resilience.errors import UnsupportedConfigError
from gym_resilience.rollout.progress import current_rollout
from gym_resilience.runner import BatchRunner, mask_failed_groups
from gym_resilience.skyrl_format import skyrl_metrics
from gym_resilience.tasks import ChatMessage, Task
from gym_resilience.trajectories import StepWiseTrajectory

__all__ = ["ResilientSkyRLGenerator", "SkyRLClientEngine", "SkyRLEnvFactory"]

# Counters that keep their meaning when SkyRL's concatenate_generator_outputs sums them over batches; the
# generator reports them only when nonzero, so a fault-free batch has SkyRL's metrics and nothing else.
_COUNTER_PREFIXES = ("rollout_errors", "retries", "env_close_errors", "envs_closed_late", "rollout_groups")


class _Batch:
    """What the engine needs of the batch being generated: each row's session id, the sampling params."""

    def __init__(
        self, session_ids: list[str], sampling_params: dict[str, Any] | None, cache_salt: Any
    ) -> None:
        self.session_ids = session_ids
        self.sampling_params = sampling_params
        self.cache_salt = cache_salt


class SkyRLClientEngine:
    """An ``Engine`` over SkyRL's ``InferenceEngineInterface``: each turn is one ``client.generate`` call
    with the batch's sampling params as SkyRL's generator passes them (stop, min_tokens, top_k, ...), the
    row's session id and the batch's cache salt. ``Sampling`` is ignored: SkyRL's params decide.

    After a stop string, as SkyRL's generator does, it appends the end-of-turn token (loss-masked) when
    ``append_eos_after_stop`` is set.
    """

    def __init__(
        self, client: Any, tokenizer: Any, *, model: str | None, append_eos_after_stop: bool = True
    ) -> None:
        self.client = client
        self._tokenizer = tokenizer
        self.model = model
        self.append_eos_after_stop = append_eos_after_stop
        self.batch: _Batch | None = None

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        batch, progress = self.batch, current_rollout()
        if batch is None or progress is None:
            raise RuntimeError("SkyRLClientEngine generates only inside a ResilientSkyRLGenerator batch")
        params = batch.sampling_params
        request = {
            "prompt_token_ids": [list(prompt_ids)],
            "session_ids": [batch.session_ids[progress.rollout_index]],
            "sampling_params": params,
            "cache_salt": batch.cache_salt,
        }
        output = await self.client.generate(request, model=self.model)
        token_ids = list(output["response_ids"][0])
        text = output["responses"][0]
        logprobs = output.get("response_logprobs")
        row_logprobs = None if logprobs is None else list(logprobs[0])
        appended = False
        stops = (params or {}).get("stop")
        eos = self._tokenizer.eos_token_id
        if (
            stops
            and self.append_eos_after_stop
            and isinstance(text, str)
            and text.endswith(tuple(stops))
            and token_ids
            and token_ids[-1] != eos
        ):
            token_ids.append(eos)
            if row_logprobs is not None:
                row_logprobs.append(0.0)
            appended = True
        return Generation(
            token_ids=token_ids,
            logprobs=row_logprobs,
            finish_reason=output["stop_reasons"][0],
            text=text,
            appended_eos=appended,
        )


class _MetricsEnv(SkyRLGymEnv):
    """A skyrl-gym env whose step ``info`` is the env's ``get_metrics()``, what SkyRL's generator records
    as a trajectory's ``env_metrics``."""

    def step(self, action: str) -> tuple[list[ChatMessage], Any, Any, bool, dict[str, Any]]:
        observations, reward, done, truncated, _ = super().step(action)
        get_metrics = getattr(self.env, "get_metrics", None)
        metrics = dict(get_metrics()) if callable(get_metrics) else {}
        return observations, reward, done, truncated, metrics


@dataclasses.dataclass(frozen=True)
class SkyRLEnvFactory:
    """Builds each row's registered skyrl-gym env: ``task.env_kwargs`` holds ``env_class`` and ``extras``,
    and ``env_configs`` maps an env class to its section of SkyRL's ``skyrl_gym`` config. It pickles, so
    the ``process`` and ``ray`` backends can build the env elsewhere."""

    specs: Mapping[str, Any]
    env_configs: Mapping[str, Any]

    def __call__(self, task: Task) -> SkyRLGymEnv:
        env_class = task.env_kwargs["env_class"]
        return _MetricsEnv(
            self.specs[env_class],
            prompt=task.prompt,
            extras=task.env_kwargs["extras"],
            env_config=self.env_configs.get(env_class, {}),
        )


# SkyRL's generator options this generator does not lay out as SkyRL does: refused rather than ignored.
def _check_supported(generator_cfg: Any) -> None:
    unsupported = {
        "batched": getattr(generator_cfg, "batched", False),
        "use_conversation_multi_turn": not getattr(generator_cfg, "use_conversation_multi_turn", True),
        "chat_template_kwargs": bool(getattr(generator_cfg, "chat_template_kwargs", None)),
        "chat_template": getattr(getattr(generator_cfg, "chat_template", None), "name_or_path", None)
        is not None,
        "inference_engine.enable_return_routed_experts": getattr(
            getattr(generator_cfg, "inference_engine", None), "enable_return_routed_experts", False
        ),
    }
    for option, refused in unsupported.items():
        if refused:
            raise UnsupportedConfigError(
                "ResilientSkyRLGenerator runs SkyRL's multi-turn chat layout only (no batched path, no "
                "single-message multi-turn, no custom chat template or template kwargs, no routed experts)",
                option=f"generator.{option}",
            )


def _resilience(resilience: RunnerConfig | Mapping[str, Any] | None, generator_cfg: Any) -> RunnerConfig:
    """The runner configuration ``resilience=`` describes; ``skip_failed_rollouts`` not given there comes
    from ``generator_cfg.skip_failed_rollouts`` where SkyRL has that field, else is True."""
    if isinstance(resilience, RunnerConfig):
        return resilience
    mapping = dict(resilience or {})
    if "skip_failed_rollouts" not in mapping:
        mapping["skip_failed_rollouts"] = bool(getattr(generator_cfg, "skip_failed_rollouts", True))
    return RunnerConfig.from_mapping(mapping, at=("resilience",))


class _ResilientSkyRLGenerator:
    """SkyRL's ``SkyRLGymGenerator`` with placeholders, retries, deadlines and env backends.

    Args:
        generator_cfg: SkyRL's ``cfg.generator``.
        skyrl_gym_cfg: SkyRL's ``cfg.environment.skyrl_gym``: each env class's section is that env's
            config, and ``max_env_workers`` the env threads.
        inference_engine_client: SkyRL's ``InferenceEngineInterface``.
        tokenizer: the policy's Hugging Face tokenizer.
        policy_model_name: passed to every ``client.generate`` as ``model``.
        resilience: a ``RunnerConfig`` or a mapping of its fields (``skip_failed_rollouts``, ``retry``,
            deadlines, ``max_failed_fraction``, ``env_backend``, ``failed_group_policy``, ...). The fields
            SkyRL's config decides (turns, input length, step-wise, logprobs, reward shape,
            post-processing) are taken from ``generator_cfg``.
        token_layout: ``"skyrl"`` (SkyRL's generator's tokens) or ``"closed"`` (every turn closed by its
            end-of-turn token, step-wise prompts token for token).
    """

    def __init__(
        self,
        generator_cfg: Any,
        skyrl_gym_cfg: Any,
        inference_engine_client: Any,
        tokenizer: Any,
        policy_model_name: str | None = None,
        *,
        resilience: RunnerConfig | Mapping[str, Any] | None = None,
        token_layout: TokenLayout = "skyrl",
    ) -> None:
        _check_supported(generator_cfg)
        self.generator_cfg = generator_cfg
        self.skyrl_gym_cfg = skyrl_gym_cfg
        self.inference_engine_client = inference_engine_client
        self.tokenizer = tokenizer
        self.policy_model_name = policy_model_name
        self.resilience = _resilience(resilience, generator_cfg)
        self.token_layout = token_layout
        self.engine = SkyRLClientEngine(
            inference_engine_client,
            tokenizer,
            model=policy_model_name,
            append_eos_after_stop=bool(
                getattr(generator_cfg, "append_eos_token_after_stop_str_in_multi_turn", True)
            ),
        )
        self.last_result: Any = None

    def _cache_salt(self) -> str | None:
        """SkyRL's prefix-cache salt: the policy and the client's weight version."""
        if not getattr(self.generator_cfg, "use_cache_salt", False):
            return None
        weight_version = getattr(self.inference_engine_client, "weight_version", None)
        if weight_version is None:
            return None
        prefix = f"{self.policy_model_name}@" if self.policy_model_name is not None else ""
        return f"{prefix}{weight_version}"

    def _config(self, logprobs: bool) -> RunnerConfig:
        cfg = self.generator_cfg
        workers = int(getattr(self.skyrl_gym_cfg, "max_env_workers", 0) or 0)
        return dataclasses.replace(
            self.resilience,
            max_turns=int(cfg.max_turns),
            max_input_length=cfg.max_input_length,
            n_samples_per_prompt=1,
            logprobs=logprobs,
            token_level_rewards=True,
            step_wise=bool(cfg.step_wise_trajectories),
            batched=False,
            zero_reward_on_non_stop=False,  # applied after SkyRL's metrics, as SkyRL's generator does
            apply_overlong_filtering=False,
            env_threads=workers if workers > 0 else self.resilience.env_threads,
            token_layout=self.token_layout,
        )

    async def generate(self, input_batch: Mapping[str, Any], disable_tqdm: bool = False) -> dict[str, Any]:
        """One batch of SkyRL's ``GeneratorInput``: SkyRL's ``GeneratorOutput`` for it, a placeholder
        standing in for each rollout that failed when ``skip_failed_rollouts`` is on."""
        utils = importlib.import_module("skyrl.train.generators.utils")
        registry = importlib.import_module("skyrl_gym").registry
        cfg = self.generator_cfg
        prompts: Sequence[Any] = input_batch["prompts"]
        env_classes: list[str] = list(input_batch["env_classes"])
        extras_in = input_batch.get("env_extras") or [{} for _ in prompts]
        trajectory_ids = input_batch.get("trajectory_ids")
        step_wise = bool(cfg.step_wise_trajectories)
        if step_wise and trajectory_ids is None:
            raise ValueError("`trajectory_ids` is a required field for step wise training")
        sampling_params = input_batch.get("sampling_params")
        effective = (
            sampling_params if sampling_params is not None else dataclasses.asdict(cfg.sampling_params)
        )
        logprobs = effective.get("logprobs") is not None

        specs = {}
        for env_class in set(env_classes):
            spec = registry.get(env_class)
            if spec is None:
                raise UnsupportedConfigError(
                    f"no skyrl-gym env is registered as {env_class!r}", option="env_classes"
                )
            specs[env_class] = spec
        env_configs = {name: getattr(self.skyrl_gym_cfg, name, {}) for name in specs}
        tasks = []
        for row, (prompt, env_class, extras) in enumerate(zip(prompts, env_classes, extras_in, strict=True)):
            extras["max_turns"] = cfg.max_turns  # as SkyRL's generator does, in the caller's dict
            tasks.append(
                Task(
                    prompt=list(prompt),
                    instance_id=str(row),
                    env_kwargs={"env_class": env_class, "extras": extras},
                )
            )
        session_ids = [
            f"{tid.instance_id}_{tid.repetition_id}" if tid is not None else f"row{row}"
            for row, tid in enumerate(trajectory_ids or [None] * len(tasks))
        ]
        self.engine.batch = _Batch(session_ids, sampling_params, self._cache_salt())
        runner = BatchRunner(self.engine, SkyRLEnvFactory(specs, env_configs), self._config(logprobs))
        try:
            result = await runner.generate(tasks)
        finally:
            self.engine.batch = None
            await asyncio.gather(
                *(self.inference_engine_client.finish_session(s) for s in session_ids), return_exceptions=True
            )
        self.last_result = result
        return self._output(result, env_classes, trajectory_ids, logprobs, utils)

    def _output(
        self, result: Any, env_classes: list[str], trajectory_ids: Any, logprobs: bool, utils: Any
    ) -> dict[str, Any]:
        cfg, output = self.generator_cfg, result.output
        step_wise = output.is_last_step is not None
        row_of_step = [
            index
            for index, trajectory in enumerate(result.trajectories)
            for _ in (trajectory.steps if isinstance(trajectory, StepWiseTrajectory) else [trajectory])
        ]
        env_metrics = [dict(row) for row in output.env_metrics or [{} for _ in row_of_step]]
        if step_wise:  # SkyRL records an env's metrics on its last step only
            env_metrics = [
                m if last else {} for m, last in zip(env_metrics, output.is_last_step, strict=True)
            ]
        times = [t.e2e_time for t in result.trajectories]
        per_rollout_times = None if any(t is None for t in times) else times
        rows_times = output.trajectory_generation_times if per_rollout_times is not None else None
        rewards, loss_masks, stop_reasons = output.rewards, output.loss_masks, output.stop_reasons
        metrics = utils.get_rollout_metrics(
            output.response_ids,
            rewards,
            env_metrics,
            [env_classes[row] for row in row_of_step],
            loss_masks,
            trajectory_completion_times=per_rollout_times,
        )
        ours = skyrl_metrics(result.metrics, _RELEASE)
        metrics.update(
            {k: v for k, v in ours.items() if k.startswith(_COUNTER_PREFIXES) and v and k not in metrics}
        )
        if cfg.zero_reward_on_non_stop:
            rewards = [
                ([0.0] * len(r) if isinstance(r, list) else 0.0) if reason != "stop" else r
                for r, reason in zip(rewards, stop_reasons, strict=True)
            ]
        if cfg.apply_overlong_filtering:
            loss_masks = utils.apply_overlong_filtering(loss_masks, stop_reasons)
        if self.resilience.failed_group_policy == "mask_group" and any(output.is_placeholder):
            groups = [
                trajectory_ids[row].instance_id if trajectory_ids is not None else row for row in row_of_step
            ]
            output.loss_masks, output.rewards = loss_masks, rewards
            masked = mask_failed_groups(result.trajectories, output, groups)
            loss_masks, rewards = output.loss_masks, output.rewards
            metrics["rollout_groups_masked"] = float(masked)
        ids = [trajectory_ids[row] for row in row_of_step] if step_wise else None
        return {
            "prompt_token_ids": output.prompt_token_ids,
            "response_ids": output.response_ids,
            "rewards": rewards,
            "loss_masks": loss_masks,
            "stop_reasons": stop_reasons,
            "rollout_metrics": metrics,
            "rollout_logprobs": output.rollout_logprobs if logprobs else None,
            "trajectory_ids": ids,
            "trajectory_generation_times": rows_times,
            "rollout_expert_indices": None,
            "is_last_step": output.is_last_step,
            "env_metrics": env_metrics,
        }


_RELEASE: Any = None
_CLASS: type[Any] | None = None


def _generator_class() -> type[Any]:
    """``_ResilientSkyRLGenerator`` as a subclass of the installed SkyRL's ``GeneratorInterface``."""
    global _CLASS, _RELEASE
    if _CLASS is None:
        from gym_resilience.skyrl_format import installed_skyrl

        release = installed_skyrl()
        if release is None:
            from gym_resilience.errors import DependencyNotInstalledError

            raise DependencyNotInstalledError(package="skyrl", extra="skyrl==0.3.0")
        base = importlib.import_module("skyrl.train.generators.base")
        _RELEASE = release
        _CLASS = type(
            "ResilientSkyRLGenerator",
            (_ResilientSkyRLGenerator, base.GeneratorInterface),
            {"__module__": __name__, "__doc__": _ResilientSkyRLGenerator.__doc__},
        )
    return _CLASS


if TYPE_CHECKING:
    ResilientSkyRLGenerator = _ResilientSkyRLGenerator
else:

    def __getattr__(name: str) -> Any:
        if name == "ResilientSkyRLGenerator":
            return _generator_class()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
