"""The ``get_generator`` override that docs/coming-from-skyrl.md gives a SkyRL user, run as written against
SkyRL 0.3.0: its imports exist, and the generator it returns survives a failing env in a real batch."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from skyrl.train.config import SkyRLTrainConfig
from skyrl.train.config.config import EnvironmentConfig
from skyrl.train.generators.base import GeneratorInterface
from skyrl_client import ScriptedClient, generator_config, generator_input, gym_config

from gym_resilience.adapters.skyrl import ResilientSkyRLGenerator

PAGE = Path(__file__).resolve().parents[2] / "docs" / "coming-from-skyrl.md"


def override_block() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```$", PAGE.read_text(encoding="utf-8"), re.MULTILINE | re.DOTALL)
    [block] = [b for b in blocks if "def get_generator" in b]
    return block


async def test_the_pages_get_generator_override_builds_a_working_generator(tokenizer: Any) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(override_block(), str(PAGE), "exec"), namespace)
    exp_class = namespace["ResilientExp"]
    cfg = SkyRLTrainConfig(
        generator=generator_config(max_turns=2),
        environment=EnvironmentConfig(env_class="gsm8k_multi_turn", skyrl_gym=gym_config()),
    )
    cfg.trainer.policy.model.path = "tiny"
    client = ScriptedClient(tokenizer)
    # BasePPOExp.__init__ starts SkyRL's whole stack; get_generator itself reads only its arguments.
    generator = exp_class.get_generator(object.__new__(exp_class), cfg, tokenizer, client)
    assert isinstance(generator, ResilientSkyRLGenerator)
    assert isinstance(generator, GeneratorInterface)
    assert generator.resilience.skip_failed_rollouts
    assert generator.resilience.failed_group_policy == "mask_group"

    output = await generator.generate(generator_input(n_prompts=2, n_samples=2))
    assert len(output["response_ids"]) == 4
    assert all(len(ids) >= 1 for ids in output["response_ids"])
