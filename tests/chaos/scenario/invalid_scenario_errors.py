"""The exact message the loader gives each file in ``tests/invalid_scenarios/``, after the file's path."""

from __future__ import annotations

from scenario_texts import INVALID_DIR

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
