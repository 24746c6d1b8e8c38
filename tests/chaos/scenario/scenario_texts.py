"""Scenario files for the loader's tests: two valid ones that use every kind of fault, where the invalid
ones and the README live, and a way to write one."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

INVALID_DIR = Path(__file__).resolve().parents[2] / "invalid_scenarios"
README = Path(__file__).resolve().parents[3] / "docs" / "scenarios.md"

IN_PROCESS_SCENARIO = """\
title: every env and in-process engine fault
description: one of each kind
tags: [env, engine]
seed: 3
batch: {env: word_game, tasks: 4, seed: 11}
engine: {kind: vllm, max_model_len: 256}
runner:
  skip_failed_rollouts: true
  max_turns: 3
  temperature: 0
  isolate_envs: true
  env_step_timeout_s: 2
  env_reset_timeout_s: 2.5
  max_failed_fraction: 0.75
  retry:
    attempts: 2
    total_delay_s: null
    retry_on: [ConnectionError, EnvStepError, 'asyncio:TimeoutError']
faults:
  - {target: env, kind: raise, method: reset, exception: ConnectionResetError, when: {rollouts: [0]}}
  - {target: env, kind: delay, delay_s: 0.2, when: {turns: [1, 2], probability: 0.5}}
  - {target: env, kind: hang, method: reset, when: {rollouts: [1], attempts: [1]}}
  - {target: env, kind: hang, method: step, when: {nth_call: [0]}}
  - {target: env, kind: interrupt, method: close, when: {rollouts: [3]}}
  - {target: env, kind: bad_output, method: step, when: {rollouts: [2], turns: [2]}}
  - {target: engine, kind: raise, exception: EngineDeadError, message: engine died}
  - {target: engine, kind: delay, delay_s: 1.5}
  - {target: engine, kind: abort, when: {turns: [0]}}
expect: {outcome: raises, error: KeyboardInterrupt}
probes:
  - {probe: batch_size, eq: 4}
  - {probe: failed, lte: 3}
  - {probe: retries, gte: 0}
  - {probe: wall_time_ratio, range: [0.5, 40]}
  - {probe: validator_passes, is: true}
  - {probe: error_type, eq: KeyboardInterrupt}
  - {probe: metrics.rollout_errors/type/EnvTimeoutError, gte: 1}
"""

SERVED_SCENARIO = """\
title: served engine and tool network faults
batch:
  env: tool_use
  tasks: 2
engine:
  kind: served
  servers: 2
faults:
  - target: engine
    kind: kill
    server: 1
    after_requests: 3
  - target: network
    kind: reset_peer
    link: engine
    when:
      nth_connection: [0, 2]
  - target: network
    kind: latency
    link: tool
    latency_s: 0.01
    when:
      probability: 0.5
  - target: network
    kind: timeout
    link: tool
probes:
  - probe: failovers
    gte: 1
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def readme_example() -> str:
    blocks = re.findall(r"```yaml\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(blocks) == 1, "the README holds exactly one yaml example"
    return blocks[0]
