"""A deterministic inference client behind SkyRL's ``InferenceEngineInterface``, and SkyRL configs.

Its generations depend only on the prompt ids, so SkyRL's ``SkyRLGymGenerator`` and
``ResilientSkyRLGenerator`` given the same client see the same model. Answers are gsm8k-shaped
(``#### <n>``): some right, some wrong, some long enough to be cut at ``max_tokens`` (finish reason
``length``). Logprobs are deterministic negative numbers.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

from skyrl.backends.skyrl_train.inference_servers.base import InferenceEngineInterface
from skyrl.train.config import GeneratorConfig, SamplingParams, SkyRLGymConfig
from skyrl.train.generators.base import TrajectoryID

DEFAULT_MAX_TOKENS = 24


class GenerateOnlyClient(InferenceEngineInterface):
    """SkyRL's ``InferenceEngineInterface`` with everything but ``generate`` answered as one engine that
    holds no weights: what SkyRL's generator and trainer step call on a client, and no more."""

    finished: list[str]  # the sessions SkyRL's generator finished, in order

    async def finish_session(self, session_id: str) -> None:
        self.finished.append(session_id)

    def get_endpoint_url(self) -> str:
        return "http://127.0.0.1:1"

    async def chat_completion(self, request_payload: Any) -> Any:
        raise NotImplementedError

    async def render_chat_completion(self, request_payload: Any) -> Any:
        raise NotImplementedError

    async def completion(self, request_payload: Any) -> Any:
        raise NotImplementedError

    async def wake_up(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def init_weight_update_communicator(self, init_info: Any) -> None:
        return None

    async def update_named_weights(self, request: Any) -> None:
        return None

    async def teardown(self) -> None:
        return None

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        return None

    async def pause_generation(self) -> None:
        return None

    async def resume_generation(self) -> None:
        return None

    async def get_world_size(self) -> tuple[int, int]:
        return 1, 1


class ScriptedClient(GenerateOnlyClient):
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls: list[dict[str, Any]] = []
        self.finished: list[str] = []

    @property
    def model_name(self) -> str:
        return "tiny"

    def _answer(self, prompt_ids: list[int]) -> str:
        digest = hashlib.blake2b(bytes(str(prompt_ids), "ascii"), digest_size=16).digest()
        kind = digest[0] % 4
        first_turn = prompt_ids.count(self.tokenizer.convert_tokens_to_ids("<|im_start|>")) == 2
        if first_turn and digest[1] % 2 == 0:
            kind = 2  # half the rollouts start with a turn cut at max_tokens, and go on
        if kind == 0:
            return "the answer is #### 42"
        if kind == 1:
            return "#### 7"
        if kind == 2:
            return "I think " + " ".join(["maybe"] * (10 + digest[1] % 20)) + " #### 42"
        return "no idea"

    async def generate(self, input_batch: Any, model: str | None = None) -> Any:
        self.calls.append({"input": copy.deepcopy(input_batch), "model": model})  # SkyRL edits its lists
        params = input_batch.get("sampling_params") or {}
        max_tokens = params.get("max_tokens", DEFAULT_MAX_TOKENS)
        eos = self.tokenizer.eos_token_id
        out: dict[str, list[Any]] = {
            "responses": [],
            "response_ids": [],
            "stop_reasons": [],
            "response_logprobs": [],
        }
        for prompt_ids in input_batch["prompt_token_ids"]:
            ids = [*self.tokenizer.encode(self._answer(prompt_ids), add_special_tokens=False), eos]
            reason = "stop"
            if len(ids) > max_tokens:
                ids, reason = ids[:max_tokens], "length"
            out["responses"].append(self.tokenizer.decode(ids, skip_special_tokens=True))
            out["response_ids"].append(ids)
            out["stop_reasons"].append(reason)
            out["response_logprobs"].append([-0.25 - (token % 7) / 10 for token in ids])
        self.calls[-1]["reasons"] = list(out["stop_reasons"])
        out["prompt_logprobs"] = None  # type: ignore[assignment]
        out["rollout_expert_indices"] = None  # type: ignore[assignment]
        return out


def generator_config(*, max_turns: int = 1, step_wise: bool = False, **fields: Any) -> GeneratorConfig:
    """SkyRL's generator config for the tests: the tiny model's short turns."""
    sampling = SamplingParams(max_generate_length=DEFAULT_MAX_TOKENS, logprobs=1)
    return GeneratorConfig(
        max_turns=max_turns,
        max_input_length=4096,
        step_wise_trajectories=step_wise,
        sampling_params=sampling,
        **fields,
    )


def gym_config() -> SkyRLGymConfig:
    return SkyRLGymConfig(max_env_workers=4)


def generator_input(
    n_prompts: int = 4, n_samples: int = 2, env_class: str = "gsm8k_multi_turn", sampling_params: Any = None
) -> dict[str, Any]:
    """SkyRL's ``GeneratorInput`` as its ``prepare_generator_input`` lays it out."""
    prompts, classes, extras, ids = [], [], [], []
    for p in range(n_prompts):
        for r in range(n_samples):
            prompts.append([{"role": "user", "content": f"What is {p} + 42 - {p}? End with '#### <n>'."}])
            classes.append(env_class)
            extras.append({"reward_spec": {"ground_truth": "42"}})
            ids.append(TrajectoryID(instance_id=f"q{p}", repetition_id=r))
    return {
        "prompts": prompts,
        "env_classes": classes,
        "env_extras": extras,
        "sampling_params": sampling_params,
        "trajectory_ids": ids,
        "batch_metadata": None,
    }
