"""What the loader refuses before it can parse (inputs built to exhaust it, files that are not files), the
README's example and tables, and the engines a scenario runs."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from scenario_texts import INVALID_DIR, README, readme_example, write

from gym_resilience import RetryPolicy, RunnerConfig, ScenarioError
from harness.judge.probes import PROBES, REGISTRY
from harness.scenario.loader import (
    MAX_SCENARIO_BYTES,
    check_text,
    load_scenario,
    parse_scenario,
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
