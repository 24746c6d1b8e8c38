"""Valid scenario files load into their compiled form: one at a time, their exception names, many at once."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from scenario_texts import IN_PROCESS_SCENARIO, SERVED_SCENARIO, write

from gym_resilience import EnvStepError, RetryPolicy, RunnerConfig, ScenarioError, UnsupportedConfigError
from gym_resilience.errors import EngineDeadError
from harness.scenario.loader import (
    check_scenario,
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
    Targeting,
)

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
