"""Invalid scenario files: each gets every problem it has, each exact and located, earliest in the file
first."""

from __future__ import annotations

import pytest
from invalid_scenario_errors import EXPECTED_ERRORS
from scenario_texts import INVALID_DIR

from gym_resilience import ScenarioError
from harness.scenario.loader import (
    check_scenario,
    check_text,
    load_scenario,
    parse_scenario,
)

INVALID_FILES = sorted(path.name for path in INVALID_DIR.glob("*.yaml"))


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
