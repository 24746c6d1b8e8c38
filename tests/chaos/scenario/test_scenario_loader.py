"""Scenario files: valid ones load into their compiled form; an invalid one gets every problem it has, each
exact and located, earliest in the file first."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

from gym_resilience import EnvStepError, RetryPolicy, RunnerConfig, ScenarioError, UnsupportedConfigError
from gym_resilience.errors import EngineDeadError
from harness.judge.probes import PROBES, REGISTRY
from harness.scenario.loader import (
    MAX_SCENARIO_BYTES,
    check_scenario,
    check_text,
    load_scenario,
    load_suite,
    parse_scenario,
    resolve_exception,
    scenario_files,
)
from harness.scenario.spec import (
    BatchSpec,
    ConnectionTargeting,
    EngineFault,
    EngineSpec,
    EnvFault,
    Expect,
    NetworkFault,
    Probe,
    Scenario,
    Targeting,
)

INVALID_DIR = Path(__file__).resolve().parents[2] / "invalid_scenarios"
README = Path(__file__).resolve().parents[3] / "docs" / "scenarios.md"

# Every file in invalid_scenarios/ and the exact message after its path (a list: every problem, in order):
# a file without an entry fails.
EXPECTED_ERRORS: dict[str, str | list[str]] = {
    "billion_laughs.yaml": ":8: the YAML holds more than 20000 values (aliases expanded)",
    "delay_beyond_an_hour.yaml": (
        ":5 at faults[0].delay_s: expected a number > 0 and <= 3600, got 1000000000.0"
    ),
    "duplicate_field.yaml": ":7 at faults: duplicate field 'faults' (first given on line 3)",
    "empty.yaml": ": the file is empty; expected a mapping of scenario fields (title, faults, probes, ...)",
    "expect_raises_without_error.yaml": (
        ":6 at expect: outcome 'raises' needs the expected error type in 'error'"
    ),
    "endpoint_not_on_loopback.yaml": (
        ":5 at engine.endpoints[1]: endpoint 'http://10.0.0.5:8000' is not on loopback: the harness sends "
        "network traffic only to this machine (127.0.0.1, ::1, localhost); run the server here, or forward "
        "a loopback port to it"
    ),
    "endpoint_with_a_path.yaml": (
        ":5 at engine.endpoints[0]: endpoint 'http://127.0.0.1:8000/v1' is not a server's base URL: drop "
        "'/v1' and give http://127.0.0.1:8000 (the harness adds /v1/completions, /health and the other "
        "routes itself)"
    ),
    "env_factory_misspelled.yaml": (
        ":4 at batch.env: module 'invalid_user_parts' has no attribute 'make_evn'; did you mean 'make_env'?"
    ),
    "env_factory_not_callable.yaml": (
        ":4 at batch.env: 'invalid_user_parts:NOT_CALLABLE' is not callable (it is int 3); expected an env "
        "factory"
    ),
    "env_module_misspelled.yaml": (
        ":4 at batch.env: cannot import module 'invalid_user_part': No module named 'invalid_user_part'; "
        "did you mean 'invalid_user_parts'?"
    ),
    "first_problem_in_file_order.yaml": [
        ":7 at probes[1].gte: expected a number, got 'many'",
        ":10 at faults[0].kind: expected one of 'raise', 'delay', 'hang', 'interrupt', 'bad_output', got "
        "'explode'",
    ],
    "hang_without_deadline.yaml": (
        ":8 at faults[0].kind: a hang in step needs runner.isolate_envs: true and "
        "runner.env_step_timeout_s set: only a deadline that kills the env's process stops a hung call, "
        "and without one the run would hang"
    ),
    "huge_integer.yaml": (
        ":2 at seed: integer 123456789012345678901234567890 is out of range: integers in a scenario fit "
        "in 64 bits"
    ),
    "infinite_delay.yaml": ":5 at faults[0].delay_s: expected a finite number, got .inf",
    "infinite_latency.yaml": ":7 at faults[0].latency_s: expected a finite number, got .inf",
    "infinite_runner_timeout.yaml": ":4 at runner.env_step_timeout_s: expected a finite number, got .inf",
    "kill_server_out_of_range.yaml": (
        ":9 at faults[0].server: server 2 does not exist: engine.servers is 2 (servers are numbered from 0)"
    ),
    "kill_without_served_engine.yaml": (
        ":7 at faults[0].kind: a kill fault needs a served engine (engine.kind: served): it SIGKILLs a "
        "vllm serve process the harness started, and engine.kind is 'vllm'"
    ),
    "malformed_date.yaml": (
        ":1 at title: cannot read '2024-13-01' as a date: month must be in 1..12; quote it to make it "
        "a string"
    ),
    "missing_fault_target.yaml": (
        ":4 at faults[0].target: missing required field 'target'; expected one of 'env', 'engine', "
        "'network', 'ray'"
    ),
    "missing_title.yaml": ":2 at title: missing required field 'title'",
    "model_folder_missing.yaml": (
        f":3 at model: model folder './checkpoints/my-sft' does not exist (looked for "
        f"{INVALID_DIR / 'checkpoints' / 'my-sft'})"
    ),
    "nan_tolerance.yaml": ":4 at probes[1].range[1]: expected a finite number, got .nan",
    "nested_too_deeply.yaml": ":2: the YAML nests deeper than 32 levels (aliases expanded)",
    "network_targeting_never_happens.yaml": [
        (
            ":12 at faults[0].when.rollouts[1]: rollout 4 never happens: the batch has 4 rollouts "
            "(4 tasks x runner.n_samples_per_prompt 1), numbered from 0"
        ),
        (
            ":12 at faults[0].when.attempts[0]: attempt 1 never happens: a rollout gets 1 attempt "
            "(runner.retry.attempts, 1 without retry), numbered from 0"
        ),
        (
            ":12 at faults[0].when.turns[0]: turn 2 never happens: runner.max_turns is 2 (turns are numbered "
            "from 0)"
        ),
    ],
    "no_tolerance.yaml": (
        ":4 at probes[0]: probe 'envs_unclosed' needs exactly one tolerance of eq, lte, gte, range, is; got 0"
    ),
    "pipeline_exits_on_import.yaml": (
        ":2 at pipeline: importing module 'exits_on_import' raised SystemExit: exits_on_import refuses "
        "to be imported"
    ),
    "pipeline_metrics_probe.yaml": (
        ":6 at probes[1].probe: probe 'metrics.rollout_errors' reads BatchRunner's metrics, and a user "
        "pipeline runs instead, which gives none; remove pipeline to test BatchRunner, or probe the batch "
        "itself (batch_size, placeholders, envs_unclosed, ...)"
    ),
    "pipeline_hang_and_interrupt.yaml": [
        (
            ":9 at faults[0].kind: a hang cannot be stopped in a user pipeline: its envs run in-process, "
            "where no deadline kills a hung call (runner settings such as isolate_envs and "
            "env_step_timeout_s apply to BatchRunner only), so the run would hang; remove pipeline to test "
            "BatchRunner, or use delay"
        ),
        (
            ":11 at faults[1].kind: an interrupt cannot be contained in a user pipeline: a KeyboardInterrupt "
            "raised in a task it starts (asyncio.gather, create_task) escapes the event loop and ends the "
            "whole run, not this scenario; remove pipeline to test BatchRunner, or use raise"
        ),
    ],
    "pipeline_interrupts_on_import.yaml": (
        ":2 at pipeline: importing module 'interrupts_on_import' raised KeyboardInterrupt"
    ),
    "pipeline_misspelled.yaml": (
        ":3 at pipeline: module 'naive_pipeline_for_invalid' has no attribute 'generat'; did you mean "
        "'generate'?"
    ),
    "pipeline_not_importable.yaml": (
        ":3 at pipeline: cannot import module 'no_such_package.rollouts': No module named 'no_such_package'"
    ),
    "problems_on_lines_4_and_8.yaml": [
        ":4 at faults[0].exception: unknown exception 'ConnectionEror': expected a built-in exception, a "
        "gym_resilience error, or module:Name; did you mean 'ConnectionError'?",
        ":8 at probes[0].gte: expected a number, got 'many'",
    ],
    "raise_base_exception.yaml": [
        (
            ":6 at faults[0].exception: 'asyncio:CancelledError' cannot be raised by a fault: raise faults "
            "take Exception subclasses, and a BaseException that is not one (SystemExit, GeneratorExit, "
            "CancelledError) would end the whole run; to interrupt the batch, use the env fault kind "
            "'interrupt'"
        ),
        (
            ":9 at faults[1].exception: 'SystemExit' cannot be raised by a fault: raise faults take "
            "Exception subclasses, and a BaseException that is not one (SystemExit, GeneratorExit, "
            "CancelledError) would end the whole run; to interrupt the batch, use the env fault kind "
            "'interrupt'"
        ),
    ],
    "range_low_above_high.yaml": (
        ":4 at probes[0]: range must be [low, high] with low <= high, got [3.0, 1.0]"
    ),
    "recursive_alias.yaml": ":2: alias *loop is inside the node it names, so it would expand forever",
    "retry_on_base_exception.yaml": (
        ":7 at runner.retry.retry_on[1]: 'KeyboardInterrupt' cannot be retried: retry_on takes Exception "
        "subclasses, and cancellation and KeyboardInterrupt always propagate"
    ),
    "rollout_never_happens.yaml": (
        ":11 at faults[0].when.rollouts[1]: rollout 8 never happens: the batch has 8 rollouts "
        "(4 tasks x runner.n_samples_per_prompt 2), numbered from 0"
    ),
    "runner_wrong_type.yaml": ":5 at runner.max_turns: expected an integer, got 'three'",
    "task_count_with_user_env.yaml": (
        ":5 at batch.tasks: a number of tasks makes tasks for the bundled envs, and batch.env is a user's "
        "env factory (invalid_user_parts:make_env); name a task loader 'module:name' or a .jsonl file of "
        "tasks"
    ),
    "task_loader_raises.yaml": (
        ":5 at batch.tasks: calling invalid_user_parts:load_broken() raised OSError: the dataset is not "
        "mounted"
    ),
    "task_loader_returns_nothing.yaml": (
        ":5 at batch.tasks: what invalid_user_parts:load_nothing() returned holds no task; a batch needs "
        "at least one"
    ),
    "tasks_file_bad_line.yaml": (
        ":5 at batch.tasks: tasks_with_a_bad_line.jsonl:3: prompt must be a list of chat messages "
        '({"role": ..., "content": ...})'
    ),
    "tool_link_without_tool_env.yaml": (
        ":8 at faults[0].link: link 'tool' needs batch.env: tool_use: only the bundled tool env talks to a "
        "tool server the harness can put a proxy in front of, and batch.env is 'word_game'"
    ),
    "top_level_list.yaml": (
        ":2: expected a mapping of scenario fields (title, faults, probes, ...) at the top level, got a list"
    ),
    "two_tolerances.yaml": (
        ":6 at probes[1]: probe 'failed' needs exactly one tolerance of eq, lte, gte, range, is; got 2"
    ),
    "unknown_exception.yaml": (
        ":6 at faults[0].exception: unknown exception 'Foo': expected a built-in exception, "
        "a gym_resilience error, or module:Name"
    ),
    "unknown_expect_error.yaml": (
        ":9 at expect.error: unknown exception 'ConectionError': expected a built-in exception, "
        "a gym_resilience error, or module:Name; did you mean 'ConnectionError'?"
    ),
    "unknown_fault_kind.yaml": (
        ":6 at faults[0].kind: expected one of 'raise', 'delay', 'hang', 'interrupt', 'bad_output', "
        "got 'explode'"
    ),
    "unknown_fault_target.yaml": (
        ":6 at faults[1].target: expected one of 'env', 'engine', 'network', 'ray', got 'disk'"
    ),
    "unknown_bundled_env.yaml": (
        ":4 at batch.env: unknown env 'word_gam': expected word_game, tool_use, or an env factory "
        "'module:name'; did you mean 'word_game'?"
    ),
    "unknown_probe.yaml": ":6 at probes[1]: unknown probe 'envs_leaked'; did you mean 'envs_unclosed'?",
    "unknown_runner_option.yaml": (
        ":4 at runner.max_turn: unknown field 'max_turn'; did you mean 'max_turns'?"
    ),
    "unknown_top_level_field.yaml": ":3 at fualts: unknown field 'fualts'; did you mean 'faults'?",
    "unsupported_runner_config.yaml": (
        ":5 at runner.skip_failed_rollouts: cannot be combined with batched=True: the batched single-turn "
        "path has no agent loop, so the flag would silently do nothing"
    ),
    "wrong_type_string_for_int.yaml": (
        ":5 at batch.tasks: expected a number of tasks in [1, 512], a task loader 'module:name', or a .jsonl "
        "file, got 'three'"
    ),
    "yaml_syntax_error.yaml": ":6: invalid YAML: mapping values are not allowed here",
}

INVALID_FILES = sorted(path.name for path in INVALID_DIR.glob("*.yaml"))

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


# --- invalid files ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", INVALID_FILES)
def test_each_invalid_scenario_file_gets_its_exact_errors_earliest_first(name: str) -> None:
    path = INVALID_DIR / name
    assert name in EXPECTED_ERRORS, f"add the expected error of {name} to EXPECTED_ERRORS"
    expected = EXPECTED_ERRORS[name]
    messages = [f"{path}{message}" for message in ([expected] if isinstance(expected, str) else expected)]
    checked = check_scenario(path)
    assert checked.scenario is None
    assert [str(problem) for problem in checked.problems] == messages
    assert all(problem.file == str(path) for problem in checked.problems)
    with pytest.raises(ScenarioError) as caught:  # load_scenario raises the earliest
        load_scenario(path)
    assert str(caught.value) == messages[0]


def test_every_expected_error_has_its_invalid_file_and_there_are_enough_of_them() -> None:
    assert sorted(EXPECTED_ERRORS) == INVALID_FILES
    assert len(INVALID_FILES) >= 50


@pytest.mark.parametrize("name", INVALID_FILES)
def test_an_invalid_file_error_chains_no_internal_exception(name: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        load_scenario(INVALID_DIR / name)
    assert caught.value.__cause__ is None
    assert caught.value.__context__ is None or caught.value.__suppress_context__


def test_the_error_names_its_field_and_line_as_attributes() -> None:
    with pytest.raises(ScenarioError) as caught:
        load_scenario(INVALID_DIR / "unknown_fault_kind.yaml")
    error = caught.value
    assert (error.field, error.line) == ("faults[0].kind", 6)
    assert error.reason.startswith("expected one of 'raise'")


def test_a_yaml_syntax_error_names_the_line_where_yaml_fails_and_no_field() -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario("title: x\nfaults:\n  - {target: env, kind: raise\nprobes: []\n", file="s.yaml")
    assert str(caught.value) == (
        "s.yaml:4: invalid YAML: expected ',' or '}', but got ':' "
        "(while parsing a flow mapping started on line 3)"
    )
    assert caught.value.field == ""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "title: t\n---\ntitle: u\n",
            "s.yaml:2: invalid YAML: a scenario file holds one YAML document, found a second one",
        ),
        (
            "title: t\x07\n",
            "s.yaml:1: invalid YAML: unacceptable character #x0007: special characters are not allowed",
        ),
        (
            "# only a comment\n",
            "s.yaml: the file is empty; expected a mapping of scenario fields (title, faults, probes, ...)",
        ),
        (
            "~\n",
            (
                "s.yaml:1: expected a mapping of scenario fields (title, faults, probes, ...) at the top "
                "level, got null"
            ),
        ),
        (
            "just words\n",
            (
                "s.yaml:1: expected a mapping of scenario fields (title, faults, probes, ...) at the top "
                "level, got 'just words'"
            ),
        ),
        (
            "title: t\n1: x\n",
            (
                "s.yaml:2: key 1 is an integer, not a string: keys must be strings (quote the key to make "
                "it one)"
            ),
        ),
        (
            "title: t\nzzzzz: 1\n",
            (
                "s.yaml:2 at zzzzz: unknown field 'zzzzz'; expected one of title, description, tags, seed, "
                "batch, engine, model, python_path, runner, cluster, pipeline, faults, expect, probes"
            ),
        ),
        ("title:\n", "s.yaml:1 at title: expected a string, got null"),
        ("title: t\ntags: abc\n", "s.yaml:2 at tags: expected a list of strings, got 'abc'"),
        ("title: t\nfaults:\n  - raise\n", "s.yaml:3 at faults[0]: expected a mapping, got 'raise'"),
        (
            "title: t\nfaults:\n  - {target: [env], kind: raise}\n",
            "s.yaml:3 at faults[0].target: expected one of 'env', 'engine', 'network', 'ray', got a list",
        ),
        (
            "title: t\nfaults:\n  - {target: network, kind: latency}\n",
            "s.yaml:3 at faults[0].link: missing required field 'link'",
        ),
        (
            "title: t\nfaults:\n  - {target: env, kind: raise, retries: 2}\n",
            (
                "s.yaml:3 at faults[0].retries: unknown field 'retries'; expected one of target, kind, "
                "method, exception, message, delay_s, when"
            ),
        ),
        (
            "title: t\nfaults:\n  - {target: env, kind: raise, when: {turn: [1]}}\n",
            "s.yaml:3 at faults[0].when.turn: unknown field 'turn'; did you mean 'turns'?",
        ),
        (
            "title: t\nfaults:\n  - target: env\n    kind: delay\n    delay_s: 0\n",
            "s.yaml:5 at faults[0].delay_s: expected a number > 0 and <= 3600, got 0",
        ),
        (
            "title: t\nfaults:\n  - target: env\n    kind: raise\n    when: {rollouts: [0, -1]}\n",
            "s.yaml:5 at faults[0].when.rollouts[1]: expected an integer >= 0, got -1",
        ),
        (
            "title: t\nfaults:\n  - target: env\n    kind: raise\n    when: {probability: 1.5}\n",
            "s.yaml:5 at faults[0].when.probability: expected a number in [0, 1], got 1.5",
        ),
        (
            "title: t\nengine: {kind: served, servers: 9}\n",
            "s.yaml:2 at engine.servers: expected an integer in [1, 4], got 9",
        ),
        ("title: t\nexpect: raises\n", "s.yaml:2 at expect: expected a mapping, got 'raises'"),
        (
            "title: t\nexpect: {outcome: completes, error: ValueError}\n",
            "s.yaml:2 at expect: 'error' only goes with outcome 'raises'",
        ),
        (
            "title: t\nprobes:\n  probe: failed\n",
            "s.yaml:2 at probes: expected a list of mappings, got a mapping",
        ),
        (
            "title: t\nprobes:\n  - {probe: failed, eq: [1]}\n",
            "s.yaml:3 at probes[0].eq: expected a number, a string, true or false, or null, got a list",
        ),
        (
            "title: t\nprobes:\n  - {probe: failed, range: [1]}\n",
            "s.yaml:3 at probes[0].range: expected a list of 2 numbers, got 1 item",
        ),
        (
            "title: t\nprobes:\n  - {probe: failed, range: [1, 2, 3]}\n",
            "s.yaml:3 at probes[0].range: expected a list of 2 numbers, got 3 items",
        ),
        (
            "title: t\nprobes:\n  - {probe: validator_passes, is: maybe}\n",
            "s.yaml:3 at probes[0].is: expected true or false, got 'maybe'",
        ),
        (
            "title: t\nprobes:\n  - {probe: 'metrics.', eq: 1}\n",
            (
                "s.yaml:3 at probes[0]: probe 'metrics.' names no metric: write metrics.<key>, the runner "
                "metric's key"
            ),
        ),
        (
            "title: t\nprobes:\n  - {probe: 'no_such_probe_at_all', eq: 1}\n",
            (
                "s.yaml:3 at probes[0]: unknown probe 'no_such_probe_at_all'; expected one of "
                "actors_left_alive, batch_size, envs_on_head_node, envs_unclosed, error_type, failed, "
                "failovers, faults_fired, identical_to_baseline, logprobs_per_token, masked_groups, "
                "nodes_used, numerical_ties, placeholder_rollouts, placeholders, retries, "
                "retries_moved_node, retries_succeeded, token_level_rewards, validator_passes, "
                "wall_over_injected_latency, wall_time_ratio, or metrics.<key>"
            ),
        ),
        (
            "title: t\npipeline: just_a_module\n",
            "s.yaml:2 at pipeline: pipeline must be 'module:name', got 'just_a_module'",
        ),
    ],
)
def test_model_errors_become_one_located_message(text: str, message: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(text, file="s.yaml")
    assert str(caught.value) == message


KEYS_FIX = "keys must be strings (quote the key to make it one)"


@pytest.mark.parametrize(
    ("text", "problems"),
    [
        (
            "title: t\nrunner: {true: 1, max_turns: 2}\n",
            ["s.yaml:2 at runner: key true is a boolean, not a string"],
        ),
        ("title: t\nrunner: {1: x}\n", ["s.yaml:2 at runner: key 1 is an integer, not a string"]),
        ("title: t\nrunner: {null: x}\n", ["s.yaml:2 at runner: key null is not a string"]),
        ("title: t\nrunner: {1.5: x}\n", ["s.yaml:2 at runner: key 1.5 is a number, not a string"]),
        (
            "title: t\nrunner:\n  retry: {false: 3}\n",
            ["s.yaml:3 at runner.retry: key false is a boolean, not a string"],
        ),
        (
            "title: t\nrunner:\n  retry: {atempts: 2, 1: 3}\n",
            [
                "s.yaml:3 at runner.retry.atempts: unknown field 'atempts'; did you mean 'attempts'?",
                "s.yaml:3 at runner.retry: key 1 is an integer, not a string",
            ],
        ),
        (
            "title: t\ncluster: {nodes: 2}\nrunner:\n  env_backend: ray\n  env_actor_options: {true: 1}\n",
            ["s.yaml:5 at runner.env_actor_options: key true is a boolean, not a string"],
        ),
        (
            "title: t\nbatch: {env: word_game, 2024-01-02: x}\n",
            ["s.yaml:2 at batch: key 2024-01-02 is a date, not a string"],
        ),
        (
            "title: t\nfaults:\n  - {target: env, kind: raise, method: step, when: {true: [1]}}\n",
            ["s.yaml:3 at faults[0].when: key true is a boolean, not a string"],
        ),
        (
            "title: t\nprobes:\n  - {probe: batch_size, eq: 8, 0: 1}\n",
            ["s.yaml:3 at probes[0]: key 0 is an integer, not a string"],
        ),
        ("title: t\ntrue: 1\n", ["s.yaml:2: key true is a boolean, not a string"]),
        # A value of the wrong type is that problem alone, whatever its keys; the file's other problems
        # are all still reported beside a key's (the misspelt field of retry above).
        (
            "title: t\nprobes:\n  - {probe: batch_size, eq: {1: 2}}\n",
            ["s.yaml:3 at probes[0].eq: expected a number, a string, true or false, or null, got a mapping"],
        ),
    ],
)
def test_a_key_that_is_not_a_string_is_named_at_its_mapping_as_the_file_writes_it_wherever_it_is(
    text: str, problems: list[str]
) -> None:
    checked = check_text(text, file="s.yaml")

    expected = [f"{p}: {KEYS_FIX}" if p.endswith("not a string") else p for p in problems]
    assert [str(problem) for problem in checked.problems] == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("title: t\nrunner: [1]\n", "s.yaml:2 at runner: expected a mapping, got a list"),
        (
            "title: t\nrunner:\n  max_turns: true\n",
            "s.yaml:3 at runner.max_turns: expected an integer, got true",
        ),
        (
            "title: t\nrunner:\n  max_concurrency: 1.5\n",
            "s.yaml:3 at runner.max_concurrency: expected an integer or null, got 1.5",
        ),
        (
            "title: t\nrunner:\n  logprobs: 'yes'\n",
            "s.yaml:3 at runner.logprobs: expected true or false, got 'yes'",
        ),
        (
            "title: t\nrunner:\n  temperature: hot\n",
            "s.yaml:3 at runner.temperature: expected a number, got 'hot'",
        ),
        ("title: t\nrunner:\n  top_p: 0\n", "s.yaml:3 at runner.top_p: must be in (0, 1], got 0.0"),
        (
            "title: t\nrunner:\n  env_step_timeout_s: 1\n",
            "s.yaml:3 at runner.env_step_timeout_s: needs env_backend='process' or 'ray' (isolate_envs=True "
            "is 'process'): a thread stuck in an env cannot be stopped, so a deadline without a process to "
            "kill would not be a deadline",
        ),
        (
            "title: t\nrunner:\n  retry: 3\n",
            (
                "s.yaml:3 at runner.retry: expected null or a mapping of RetryPolicy fields (attempts, "
                "initial_delay_s, max_delay_s, jitter_s, total_delay_s, retry_on), got 3"
            ),
        ),
        (
            "title: t\nrunner:\n  retry: {attempts: 0}\n",
            "s.yaml:3 at runner.retry.attempts: must be an int >= 1, got 0",
        ),
        (
            "title: t\nrunner:\n  retry: {sleep: 1}\n",
            (
                "s.yaml:3 at runner.retry.sleep: unknown field 'sleep'; expected one of attempts, "
                "initial_delay_s, max_delay_s, jitter_s, total_delay_s, retry_on"
            ),
        ),
        (
            "title: t\nrunner:\n  retry: {retry_on: ConnectionError}\n",
            "s.yaml:3 at runner.retry.retry_on: expected a list of exception names, got 'ConnectionError'",
        ),
        (
            "title: t\nrunner:\n  retry:\n    retry_on: [Nope]\n",
            (
                "s.yaml:4 at runner.retry.retry_on[0]: unknown exception 'Nope': expected a built-in "
                "exception, a gym_resilience error, or module:Name"
            ),
        ),
        (
            "title: t\nfaults:\n  - {target: env, kind: raise, exception: EnvStepError}\n",
            "s.yaml:3 at faults[0].exception: exception 'EnvStepError' cannot be raised with a message: "
            "EnvStepError(message) raised TypeError: EnvStepError.__init__() takes 1 positional argument "
            "but 2 were given; name one that takes a single message argument",
        ),
        (
            "title: t\nfaults:\n  - {target: engine, kind: raise, exception: 'json:dumps'}\n",
            "s.yaml:3 at faults[0].exception: 'json:dumps' is not an exception class",
        ),
        (
            "title: t\nfaults:\n  - {target: env, kind: bad_output, method: close}\n",
            (
                "s.yaml:3 at faults[0].method: bad_output cannot target close: close() returns nothing, so "
                "the fault would do nothing"
            ),
        ),
        (
            "title: t\nfaults:\n  - {target: network, kind: timeout, link: engine}\n",
            (
                "s.yaml:3 at faults[0].link: link 'engine' needs an engine behind HTTP (engine.kind: served "
                "or openai): the fault proxy sits on the connections to its endpoints, and engine.kind is "
                "'vllm'"
            ),
        ),
        (
            "title: t\nfaults:\n  - {target: env, kind: hang, method: close}\n",
            (
                "s.yaml:3 at faults[0].kind: a hang in close needs runner.isolate_envs: true: only an "
                "isolated env's close is killed at its deadline, and a close that never returns would hang "
                "the run"
            ),
        ),
        (
            "title: t\nrunner: {isolate_envs: true}\nfaults:\n  - {target: env, kind: hang, method: reset}\n",
            (
                "s.yaml:4 at faults[0].kind: a hang in reset needs runner.isolate_envs: true and "
                "runner.env_reset_timeout_s set: only a deadline that kills the env's process stops a hung "
                "call, and without one the run would hang"
            ),
        ),
        (
            "title: t\nfaults:\n  - {target: engine, kind: abort, when: {turns: [1]}}\n",
            (
                "s.yaml:3 at faults[0].when.turns[0]: turn 1 never happens: runner.max_turns is 1 (turns "
                "are numbered from 0)"
            ),
        ),
        (
            "title: t\nfaults:\n  - {target: engine, kind: abort, when: {attempts: [1]}}\n",
            (
                "s.yaml:3 at faults[0].when.attempts[0]: attempt 1 never happens: a rollout gets 1 attempt "
                "(runner.retry.attempts, 1 without retry), numbered from 0"
            ),
        ),
        (
            "title: t\nfaults:\n  - {target: env, kind: raise, method: reset, when: {turns: [0]}}\n",
            (
                "s.yaml:3 at faults[0].when.turns: turns never match a reset fault: reset has no turn "
                "(turns count the steps since reset)"
            ),
        ),
        (
            "title: t\npipeline: 'json:dumps'\n",
            (
                "s.yaml:2 at pipeline: 'json:dumps' is not an async function; expected async def "
                "dumps(tasks, env_factory, engine)"
            ),
        ),
        ("title: t\npipeline: 'json:nope'\n", "s.yaml:2 at pipeline: module 'json' has no attribute 'nope'"),
    ],
)
def test_semantic_errors_become_one_located_message(text: str, message: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(text, file="s.yaml")
    assert str(caught.value) == message


# --- valid files ------------------------------------------------------------------------------------------


def test_a_scenario_with_every_env_and_in_process_engine_fault_loads(tmp_path: Path) -> None:
    compiled = load_scenario(write(tmp_path, "in_process.yaml", IN_PROCESS_SCENARIO))
    scenario = compiled.spec
    assert scenario.batch == BatchSpec(env="word_game", tasks=4, seed=11)
    assert scenario.engine == EngineSpec(kind="vllm", max_model_len=256)
    assert compiled.exceptions == {0: ConnectionResetError, 6: EngineDeadError}
    assert compiled.expected_error is KeyboardInterrupt
    assert [task.instance_id for task in compiled.tasks] == [f"word_game-11-{i:04d}" for i in range(4)]
    assert (compiled.env_factory, compiled.pipeline, compiled.model_dir) == (None, None, None)
    assert [(type(f), f.kind) for f in scenario.faults] == [
        (EnvFault, "raise"),
        (EnvFault, "delay"),
        (EnvFault, "hang"),
        (EnvFault, "hang"),
        (EnvFault, "interrupt"),
        (EnvFault, "bad_output"),
        (EngineFault, "raise"),
        (EngineFault, "delay"),
        (EngineFault, "abort"),
    ]
    assert scenario.faults[0] == EnvFault(
        target="env",
        kind="raise",
        method="reset",
        exception="ConnectionResetError",
        when=Targeting(rollouts=[0]),
    )
    assert scenario.faults[1].when == Targeting(turns=[1, 2], probability=0.5)
    assert scenario.expect == Expect(outcome="raises", error="KeyboardInterrupt")
    assert scenario.probes[3] == Probe(probe="wall_time_ratio", range=(0.5, 40.0))
    assert scenario.probes[4].is_ is True


def test_a_scenario_with_a_served_engine_and_every_network_fault_loads(tmp_path: Path) -> None:
    compiled = load_scenario(write(tmp_path, "served.yaml", SERVED_SCENARIO))
    scenario = compiled.spec
    assert scenario.engine == EngineSpec(kind="served", servers=2)
    assert scenario.faults == [
        EngineFault(target="engine", kind="kill", server=1, after_requests=3),
        NetworkFault(
            target="network",
            kind="reset_peer",
            link="engine",
            when=ConnectionTargeting(nth_connection=[0, 2]),
        ),
        NetworkFault(
            target="network",
            kind="latency",
            link="tool",
            latency_s=0.01,
            when=ConnectionTargeting(probability=0.5),
        ),
        NetworkFault(target="network", kind="timeout", link="tool"),
    ]
    assert compiled.config == RunnerConfig()


def test_the_compiled_scenario_holds_the_runner_config_with_its_retry_policy(tmp_path: Path) -> None:
    config = load_scenario(write(tmp_path, "in_process.yaml", IN_PROCESS_SCENARIO)).config
    assert config.retry == RetryPolicy(
        attempts=2, total_delay_s=None, retry_on=(ConnectionError, EnvStepError, TimeoutError)
    )
    expected = RunnerConfig(
        skip_failed_rollouts=True,
        max_turns=3,
        isolate_envs=True,
        env_step_timeout_s=2.0,
        env_reset_timeout_s=2.5,
        max_failed_fraction=0.75,
        retry=config.retry,
    )
    assert config == expected
    assert isinstance(config.temperature, float)


@pytest.mark.parametrize(
    ("mapping", "path", "reason"),
    [
        ({"max_turns": "three"}, ("runner", "max_turns"), "expected an integer, got 'three'"),
        (
            {"retry": {"attempts": 0}},
            ("runner", "retry", "attempts"),
            "must be an int >= 1, got 0",
        ),
        (
            {"retry": {"retry_on": ["ConnectionError", "KeyboardInterrupt"]}},
            ("runner", "retry", "retry_on", 1),
            "'KeyboardInterrupt' cannot be retried: retry_on takes Exception subclasses, and cancellation "
            "and KeyboardInterrupt always propagate",
        ),
        (
            {"skip_failed_rollouts": True, "batched": True},
            ("runner", "skip_failed_rollouts"),
            "cannot be combined with batched=True: the batched single-turn path has no agent loop, so the "
            "flag would silently do nothing",
        ),
        ({"max_turn": 2}, ("runner", "max_turn"), "unknown field 'max_turn'; did you mean 'max_turns'?"),
    ],
)
def test_runner_config_from_mapping_names_the_path_of_a_bad_value_in_a_typed_error(
    mapping: dict[str, object], path: tuple[str | int, ...], reason: str
) -> None:
    with pytest.raises(UnsupportedConfigError) as caught:
        RunnerConfig.from_mapping(mapping)
    assert (caught.value.path, caught.value.reason) == (path, reason)
    dotted = ".".join(str(p) for p in path if isinstance(p, str)) + "".join(
        f"[{p}]" for p in path if isinstance(p, int)
    )
    assert caught.value.option == dotted
    assert str(caught.value) == f"{dotted}: {reason}"


def test_runner_config_from_mapping_builds_the_config_and_resolves_names_with_the_given_resolver() -> None:
    config = RunnerConfig.from_mapping(
        {"max_turns": 2, "generation_timeout_s": 3, "retry": {"attempts": 2, "retry_on": ["Custom"]}},
        exceptions={"Custom": ConnectionAbortedError}.__getitem__,
    )
    assert config == RunnerConfig(
        max_turns=2,
        generation_timeout_s=3.0,
        retry=RetryPolicy(attempts=2, retry_on=(ConnectionAbortedError,)),
    )
    assert isinstance(config.generation_timeout_s, float)


@pytest.mark.parametrize(
    ("tolerance", "observed", "held"),
    [
        ("eq: true", 1, False),
        ("eq: false", 0, False),
        ("eq: 1", True, False),
        ("eq: 1.0", True, False),
        ("eq: 0", False, False),
        ("eq: true", True, True),
        ("eq: false", False, True),
        ("eq: 1", 1, True),
        ("eq: 1", 1.0, True),
        ("eq: '1'", "1", True),
    ],
)
def test_eq_never_takes_a_boolean_for_a_number_or_a_number_for_a_boolean(
    tolerance: str, observed: object, held: bool
) -> None:
    probe = parse_scenario(f"title: t\nprobes:\n  - {{probe: failed, {tolerance}}}\n").spec.probes[0]
    assert probe.holds(observed) is held


def test_a_user_pipeline_next_to_the_scenario_file_imports(tmp_path: Path) -> None:
    (tmp_path / "my_pipeline_for_loader_test.py").write_text(
        "async def generate(tasks, env_factory, engine):\n    return []\n\n"
        "async def no_arguments():\n    return []\n"
    )
    scenario = load_scenario(
        write(tmp_path, "p.yaml", "title: t\npipeline: my_pipeline_for_loader_test:generate\n")
    )
    assert scenario.spec.pipeline == "my_pipeline_for_loader_test:generate"
    assert scenario.pipeline is sys.modules["my_pipeline_for_loader_test"].generate
    with pytest.raises(ScenarioError) as caught:
        load_scenario(
            write(tmp_path, "q.yaml", "title: t\npipeline: my_pipeline_for_loader_test:no_arguments\n")
        )
    assert str(caught.value) == (
        f"{tmp_path / 'q.yaml'}:2 at pipeline: 'my_pipeline_for_loader_test:no_arguments' cannot be called "
        "with (tasks, env_factory, engine): too many positional arguments; "
        "expected async def no_arguments(tasks, env_factory, engine)"
    )
    # For good: isolated env workers, started later, import the user's modules again by name.
    assert str(tmp_path.resolve()) in sys.path


def test_a_pipeline_engine_fault_can_only_be_targeted_by_call_number_or_probability(tmp_path: Path) -> None:
    (tmp_path / "another_pipeline_for_loader_test.py").write_text(
        "async def generate(tasks, env_factory, engine):\n    return []\n"
    )
    text = (
        "title: t\npipeline: another_pipeline_for_loader_test:generate\nfaults:\n"
        "  - {target: engine, kind: raise, when: {nth_call: [1], probability: 0.5}}\n"
        "  - {target: env, kind: raise, when: {rollouts: [7], attempts: [0]}}\n"
        "  - {target: engine, kind: raise, when: {rollouts: [0]}}\n"
    )
    with pytest.raises(ScenarioError) as caught:
        load_scenario(write(tmp_path, "p.yaml", text))
    assert str(caught.value).endswith(
        ":6 at faults[2].when.rollouts: rollouts never match here: in a user pipeline an engine call has no "
        "rollout, attempt or turn; target it with nth_call or probability"
    )
    load_scenario(write(tmp_path, "q.yaml", text.rsplit("  - {target: engine", 1)[0]))


def test_a_pipeline_network_fault_is_held_to_the_pipelines_rollouts_and_engine_link_filters(
    tmp_path: Path,
) -> None:
    (tmp_path / "network_pipeline_for_loader_test.py").write_text(
        "async def generate(tasks, env_factory, engine):\n    return []\n"
    )
    text = (
        "title: t\npipeline: network_pipeline_for_loader_test:generate\nengine: {kind: served}\n"
        "batch: {env: tool_use, tasks: 2}\nfaults:\n"
        "  - {target: network, kind: timeout, link: tool, when: {rollouts: [2]}}\n"
        "  - {target: network, kind: timeout, link: engine, when: {turns: [0]}}\n"
        "  - {target: network, kind: timeout, link: engine, when: {nth_connection: [0]}}\n"
    )
    checked = check_scenario(write(tmp_path, "p.yaml", text))
    assert [str(problem).split(" at ", 1)[1] for problem in checked.problems] == [
        "faults[0].when.rollouts[0]: rollout 2 never happens: in a user pipeline an env's rollout is its "
        "task's index, and the batch has 2 tasks (numbered from 0)",
        "faults[1].when.turns: turns never match here: in a user pipeline an engine call has no rollout, "
        "attempt or turn; target it with nth_connection",
    ]


def test_yaml_anchors_and_merge_keys_load_as_safe_load_reads_them(tmp_path: Path) -> None:
    text = """\
    title: anchors
    faults:
      - &flaky {target: env, kind: raise, exception: ConnectionError, when: {rollouts: [0]}}
      - <<: *flaky
        when: {rollouts: [1]}
        kind: explode
    """
    with pytest.raises(ScenarioError) as caught:
        load_scenario(write(tmp_path, "a.yaml", text))
    assert str(caught.value).endswith(
        ":6 at faults[1].kind: expected one of 'raise', 'delay', 'hang', 'interrupt', 'bad_output', got "
        "'explode'"
    )
    scenario = load_scenario(write(tmp_path, "b.yaml", text.replace("        kind: explode\n", "")))
    assert scenario.faults[1] == EnvFault(
        target="env", kind="raise", exception="ConnectionError", when=Targeting(rollouts=[1])
    )


# --- exception names --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("ConnectionError", ConnectionError),
        ("KeyboardInterrupt", KeyboardInterrupt),
        ("EnvStepError", EnvStepError),
        ("EngineDeadError", EngineDeadError),
        ("asyncio:CancelledError", asyncio.CancelledError),
        ("json:JSONDecodeError", json.JSONDecodeError),
    ],
)
def test_resolve_exception_finds_builtins_library_errors_and_module_paths(
    name: str, expected: type[BaseException]
) -> None:
    assert resolve_exception(name) is expected


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "Foo",
            "unknown exception 'Foo': expected a built-in exception, a gym_resilience error, or module:Name",
        ),
        (
            "print",
            (
                "unknown exception 'print': expected a built-in exception, a gym_resilience error, or "
                "module:Name"
            ),
        ),
        (
            "asyncio.CancelledError",
            (
                "unknown exception 'asyncio.CancelledError': expected a built-in exception, a "
                "gym_resilience error, or module:Name; did you mean 'asyncio:CancelledError'?"
            ),
        ),
        ("json:dumps", "'json:dumps' is not an exception class"),
        ("json:Nope", "module 'json' has no attribute 'Nope'"),
        (
            "no_such_module_x:Err",
            (
                "cannot import module 'no_such_module_x' for exception 'no_such_module_x:Err': No module "
                "named 'no_such_module_x'"
            ),
        ),
        (":Err", "exception ':Err' must be module:Name"),
    ],
)
def test_resolve_exception_says_why_a_name_does_not_resolve(name: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        resolve_exception(name)
    assert str(caught.value) == message


# --- many files -------------------------------------------------------------------------------------------


def test_load_suite_expands_folders_to_their_yaml_files_in_name_order(tmp_path: Path) -> None:
    folder = tmp_path / "suite"
    folder.mkdir()
    for name in ("b.yml", "a.yaml", "c.yaml"):
        write(folder, name, f"title: {name}\n")
    write(folder, "notes.md", "not a scenario")
    (folder / "nested").mkdir()
    write(folder / "nested", "d.yaml", "title: d\n")
    extra = write(tmp_path, "extra.yaml", "title: extra\n")
    suite = load_suite([extra, folder, folder / "a.yaml"])
    assert suite.valid
    assert [(scenario.file.name, scenario.title) for scenario in suite.scenarios] == [
        ("extra.yaml", "extra"),
        ("a.yaml", "a.yaml"),
        ("b.yml", "b.yml"),
        ("c.yaml", "c.yaml"),
    ]


def test_load_suite_reports_every_missing_path_empty_folder_and_problem_and_keeps_the_valid_files(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "suite"
    folder.mkdir()
    write(folder, "a.yaml", "title: fine\n")
    write(folder, "b.yaml", "title: [broken\n")
    write(folder, "c.yaml", "title: two\nbatch: {tasks: 0}\nprobes:\n  - {probe: faults_fird, eq: 1}\n")
    write(folder, "d.yaml", "title: also fine\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    suite = load_suite([tmp_path / "missing.yaml", folder, empty])
    assert not suite.valid
    assert [scenario.title for scenario in suite.scenarios] == ["fine", "also fine"]
    assert [str(problem) for problem in suite.problems] == [
        f"{tmp_path / 'missing.yaml'}: no such file or directory",
        f"{empty}: no scenario files (*.yaml, *.yml) in this directory",
        f"{folder / 'b.yaml'}:2: invalid YAML: expected ',' or ']', but got '<stream end>' (while parsing a "
        "flow sequence started on line 1)",
        f"{folder / 'c.yaml'}:2 at batch.tasks: expected a number of tasks in [1, 512], a task loader "
        "'module:name', or a .jsonl file, got 0",
        f"{folder / 'c.yaml'}:4 at probes[0]: unknown probe 'faults_fird'; did you mean 'faults_fired'?",
    ]
    files, problems = scenario_files([empty])
    assert files == []
    assert [str(problem) for problem in problems] == [
        f"{empty}: no scenario files (*.yaml, *.yml) in this directory"
    ]


def test_load_scenario_reports_a_missing_file_and_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError) as caught:
        load_scenario(tmp_path / "nope.yaml")
    assert str(caught.value) == f"{tmp_path / 'nope.yaml'}: no such file"
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"title: t\n\xff\xfe\n")
    with pytest.raises(ScenarioError) as caught:
        load_scenario(binary)
    assert str(caught.value) == f"{binary}:2: not UTF-8 text (byte 0xff)"


# --- inputs that can never work, and inputs built to exhaust the loader -----------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "title: t\nprobes:\n  - {probe: failed, eq: .nan}\n",
            "s.yaml:3 at probes[0].eq: expected a finite number, got .nan",
        ),
        (
            "title: t\nprobes:\n  - {probe: failed, lte: .nan}\n",
            "s.yaml:3 at probes[0].lte: expected a finite number, got .nan",
        ),
        (
            "title: t\nprobes:\n  - {probe: failed, gte: -.inf}\n",
            "s.yaml:3 at probes[0].gte: expected a finite number, got -.inf",
        ),
        (
            "title: t\nrunner:\n  retry: {max_delay_s: .nan}\n",
            "s.yaml:3 at runner.retry.max_delay_s: expected a finite number, got .nan",
        ),
        (
            "title: t\nrunner:\n  generation_timeout_s: .inf\n",
            "s.yaml:3 at runner.generation_timeout_s: expected a finite number, got .inf",
        ),
        (
            "title: t\nfaults:\n  - {target: env, kind: delay, delay_s: 3600.5}\n",
            "s.yaml:3 at faults[0].delay_s: expected a number > 0 and <= 3600, got 3600.5",
        ),
        (
            "title: t\nseed: -9223372036854775809\n",
            (
                "s.yaml:2 at seed: integer -9223372036854775809 is out of range: integers in a scenario "
                "fit in 64 bits"
            ),
        ),
        (
            "title: t\nbatch:\n  seed: " + "7" * 5000 + "\n",
            (
                "s.yaml:3 at batch.seed: integer 77777777777777777777... (5000 characters) is out of range: "
                "integers in a scenario fit in 64 bits"
            ),
        ),
        (
            "title: !!bool maybe\n",
            "s.yaml:1 at title: cannot read 'maybe' as true or false; quote it to make it a string",
        ),
        (
            "title: t\ntags: &a [x, {y: *a}]\n",
            "s.yaml:2: alias *a is inside the node it names, so it would expand forever",
        ),
        (
            "title: t\ntags: [" + ", ".join(["x"] * 20_001) + "]\n",
            "s.yaml:2: the YAML holds more than 20000 values (aliases expanded)",
        ),
        (
            "title: t\nrunner:\n" + "".join(f"  {'  ' * level}k{level}:\n" for level in range(40)),
            "s.yaml:33: the YAML nests deeper than 32 levels (aliases expanded)",
        ),
    ],
)
def test_values_that_cannot_work_or_would_exhaust_the_loader_are_refused_at_their_line(
    text: str, message: str
) -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(text, file="s.yaml")
    assert str(caught.value) == message


def test_the_bounds_themselves_are_valid_values() -> None:
    scenario = parse_scenario(
        "title: t\nseed: 9223372036854775807\nbatch: {seed: -9223372036854775808}\n"
        "faults:\n  - {target: env, kind: delay, delay_s: 3600}\n",
        file="s.yaml",
    )
    assert scenario.spec.seed == 2**63 - 1
    assert scenario.faults == [EnvFault(target="env", kind="delay", delay_s=3600.0)]


def test_an_alias_used_many_times_within_the_value_limit_loads() -> None:
    text = "title: t\nfaults:\n  - &flaky {target: env, kind: raise, when: {rollouts: [0]}}\n"
    text += "  - *flaky\n" * 49
    faults = parse_scenario(text, file="s.yaml").faults
    assert len(faults) == 50
    assert faults[49] == EnvFault(target="env", kind="raise", when=Targeting(rollouts=[0]))


def test_a_user_exception_module_that_exits_on_import_is_that_fields_error() -> None:
    text = "title: t\nexpect: {outcome: raises, error: 'exits_on_import:Refused'}\n"
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(text, file="s.yaml", folder=INVALID_DIR)
    assert str(caught.value) == (
        "s.yaml:2 at expect.error: importing module 'exits_on_import' for exception "
        "'exits_on_import:Refused' raised SystemExit: exits_on_import refuses to be imported"
    )


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "scenario.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ScenarioError) as caught:
        load_scenario(fifo)
    assert str(caught.value) == f"{fifo}: is a FIFO, not a regular file; give a scenario file"


def test_a_device_that_never_ends_is_refused_without_reading_it() -> None:
    with pytest.raises(ScenarioError) as caught:
        load_scenario("/dev/zero")
    assert str(caught.value) == "/dev/zero: is a device, not a regular file; give a scenario file"


def test_a_file_over_the_size_limit_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("title: t\n" + "#" * MAX_SCENARIO_BYTES)
    with pytest.raises(ScenarioError) as caught:
        load_scenario(big)
    assert str(caught.value) == (
        f"{big}: the file is 262,153 bytes; a scenario file is at most 262,144 bytes (256 KiB)"
    )
    big.write_bytes(b"title: t\n".ljust(MAX_SCENARIO_BYTES, b" "))
    assert load_scenario(big).title == "t"


def test_a_directory_given_as_a_scenario_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError) as caught:
        load_scenario(tmp_path)
    assert str(caught.value) == f"{tmp_path}: is a directory, not a scenario file"


# --- the README -------------------------------------------------------------------------------------------


def test_the_readme_example_is_a_valid_scenario(tmp_path: Path) -> None:
    scenario = load_scenario(write(tmp_path, "example.yaml", readme_example()))
    assert {fault.target for fault in scenario.faults} == {"env", "engine"}
    assert scenario.config.skip_failed_rollouts


def test_the_readme_documents_every_probe_and_every_field() -> None:
    text = README.read_text()
    models = [Scenario, BatchSpec, EngineSpec, EnvFault, EngineFault, NetworkFault, Targeting]
    models += [ConnectionTargeting, Expect, Probe]
    names = {field.alias or name for model in models for name, field in model.model_fields.items()}
    names |= {field.name for field in dataclasses.fields(RunnerConfig)}
    names |= {field.name for field in dataclasses.fields(RetryPolicy)} - {"sleep", "async_sleep"}
    names |= set(PROBES)
    missing = sorted(name for name in names if f"`{name}`" not in text)
    assert missing == []


def test_the_readme_probe_table_is_the_probe_registry_row_for_row() -> None:
    text = README.read_text()
    table = text[text.index("| Probe | Observes |") :].split("\n\n")[0].splitlines()[2:]
    rows = [tuple(cell.strip() for cell in line.strip("|").split("|", 1)) for line in table]
    assert rows == [
        *((f"`{probe.name}`", probe.description) for probe in REGISTRY),
        (
            "`metrics.<key>`",
            "the runner metric `<key>` of the faulted run, e.g. "
            "`metrics.rollout_errors/type/EnvTimeoutError`; a count the runner leaves out when it is zero "
            "(`retries`, `retries/rollouts`, `retries/succeeded`, `retries/exhausted`, "
            "`rollout_errors/type/<name>`, `rollout_errors/cause/<name>`, `rollout_errors/phase/<name>`) "
            "reads 0 once `BatchRunner` finished the batch. Not with a `pipeline`, which gives no runner "
            "metrics",
        ),
    ]


# --- engines the user runs --------------------------------------------------------------------------------


def test_an_openai_engine_takes_loopback_endpoints_that_engine_link_faults_count(tmp_path: Path) -> None:
    text = (
        "title: t\n"
        "engine: {kind: openai, endpoints: ['http://127.0.0.1:8000/', 'http://localhost:8001']}\n"
        "faults:\n"
        "  - {target: network, kind: reset_peer, link: engine, endpoint: 1}\n"
    )
    compiled = parse_scenario(text, file="s.yaml")
    assert compiled.spec.engine.endpoints == ["http://127.0.0.1:8000", "http://localhost:8001"]
    assert compiled.summary() == (
        "OpenAI endpoints http://127.0.0.1:8000, http://localhost:8001 serving the bundled tiny model; "
        "env word_game, 8 tasks; BatchRunner; 1 fault, 0 probes"
    )


@pytest.mark.parametrize(
    ("url", "drop", "base"),
    [
        ("http://127.0.0.1:8000/v1", "/v1", "http://127.0.0.1:8000"),
        ("http://localhost:8001/v1/", "/v1/", "http://localhost:8001"),
        ("http://[::1]:8002/api/v1", "/api/v1", "http://[::1]:8002"),
        ("http://127.0.0.1:8003?model=x", "?model=x", "http://127.0.0.1:8003"),
    ],
)
def test_an_endpoint_is_the_servers_base_url_without_a_path(url: str, drop: str, base: str) -> None:
    # The harness adds /v1/completions and /health itself: with /v1 given, every request would be a 404.
    text = f"title: t\nengine: {{kind: openai, endpoints: ['{url}']}}\n"
    assert [str(problem) for problem in check_text(text, file="s.yaml").problems] == [
        f"s.yaml:2 at engine.endpoints[0]: endpoint {url!r} is not a server's base URL: drop {drop!r} and "
        f"give {base} (the harness adds /v1/completions, /health and the other routes itself)"
    ]


def test_every_engine_field_that_does_not_fit_its_kind_is_reported_at_its_line() -> None:
    text = (
        "title: t\n"
        "engine:\n"
        "  kind: openai\n"
        "  servers: 2\n"
        "  endpoints: ['http://127.0.0.1:8000', 'https://127.0.0.1:8001', 'http://127.0.0.1:8000']\n"
        "faults:\n"
        "  - {target: engine, kind: kill}\n"
        "  - {target: network, kind: latency, link: engine, endpoint: 3}\n"
    )
    problems = [str(problem) for problem in check_text(text, file="s.yaml").problems]
    assert problems == [
        "s.yaml:5 at engine.endpoints[1]: expected an http://HOST:PORT URL, got 'https://127.0.0.1:8001'",
    ]
    text = text.replace("'https://127.0.0.1:8001', ", "")
    problems = [str(problem) for problem in check_text(text, file="s.yaml").problems]
    assert problems == [
        "s.yaml:4 at engine.servers: servers only goes with kind 'served' (servers the harness starts), and "
        "kind is 'openai'",
        "s.yaml:5 at engine.endpoints[1]: endpoint 'http://127.0.0.1:8000' is listed twice",
        "s.yaml:7 at faults[0].kind: a kill fault needs a served engine (engine.kind: served): it SIGKILLs "
        "a vllm serve process the harness started, and engine.kind is 'openai'",
        "s.yaml:8 at faults[1].endpoint: endpoint 3 does not exist: 2 endpoints (endpoints are numbered "
        "from 0)",
    ]
    problems = [str(p) for p in check_text("title: t\nengine: {kind: openai}\n", file="s.yaml").problems]
    assert problems == [
        "s.yaml:2 at engine.kind: kind 'openai' needs endpoints: the URLs of the OpenAI-compatible servers "
        "you run on loopback (endpoints: [http://127.0.0.1:8000])"
    ]
    problems = [
        str(p)
        for p in check_text("title: t\nengine: {endpoints: ['http://[::1]:80']}\n", file="s.yaml").problems
    ]
    assert problems == [
        "s.yaml:2 at engine.endpoints: endpoints only go with kind 'openai' (servers you run), and kind is "
        "'vllm'"
    ]
