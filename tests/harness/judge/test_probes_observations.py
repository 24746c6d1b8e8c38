"""What the probes observe when a batch is unusual: a probe that cannot be computed for the batch observes
None (and says why) without costing the other probes, and a runner counter that is zero reads 0.0."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from gym_resilience import Trajectory, TrajectoryId, build_batch_output
from harness.judge.probes import RunOutcome
from harness.judge.verdict import judge
from harness.scenario.loader import check_text, parse_scenario


def outcome(trajectories: list[Trajectory] | None, metrics: dict[str, float] | None = None) -> RunOutcome:
    output = build_batch_output(trajectories) if trajectories is not None else None
    return RunOutcome(trajectories, output, metrics or {}, None, 1.0, 3, 0)


def rows(ids: bool) -> list[Trajectory]:
    return [
        Trajectory([1, 2], [3, 4], 1.0, [1, 1], "stop", trajectory_id=TrajectoryId(f"t{i}") if ids else None)
        for i in range(3)
    ]


def scenario(probes: str) -> Any:
    return parse_scenario(f"title: probes\nbatch: {{env: word_game, tasks: 3}}\nprobes:\n{probes}")


def test_a_probe_that_cannot_be_computed_for_the_batch_observes_none_and_the_others_are_judged() -> None:
    # Rows without trajectory ids: group-relative advantages (masked_groups) refuse the batch.
    compiled = scenario(
        "  - {probe: batch_size, eq: 3}\n"
        "  - {probe: identical_to_baseline, is: true}\n"
        "  - {probe: masked_groups, eq: 0}\n"
    )
    result = judge(compiled, compiled.config, outcome(rows(ids=False)), outcome(rows(ids=False)))
    observed = {p.probe: (p.observed, p.held) for p in result.probes}
    assert observed == {
        "outcome": ("completes", True),
        "batch_size": (3, True),
        "identical_to_baseline": (True, True),
        "masked_groups": (None, False),
    }
    assert result.status == "deviated"
    detail = result.probes[-1].detail
    assert detail.startswith("cannot be observed for this batch: OutputValidationError: ")
    assert "\n" not in detail


def test_a_scenario_that_does_not_ask_for_the_probe_holds() -> None:
    compiled = scenario("  - {probe: batch_size, eq: 3}\n")
    result = judge(compiled, compiled.config, outcome(rows(ids=False)), outcome(rows(ids=False)))
    assert (result.status, result.message) == ("held", "")


def test_runner_counters_left_out_when_zero_read_zero() -> None:
    metrics = {"rollouts": 3.0, "rollout_errors": 1.0, "rollout_errors/type/EnvStepError": 1.0}
    wanted = [
        "retries",
        "retries/succeeded",
        "rollout_errors/type/EnvStepError",
        "rollout_errors/type/TimeoutError",
        "rollout_errors/cause/ConnectionResetError",
        "rollout_errors/phase/reset",
        "e2e_time/mean",  # not a count: absent is nothing to observe
        "retries/typo",  # no such counter
    ]
    compiled = scenario("".join(f"  - {{probe: metrics.{key}, lte: 1}}\n" for key in wanted))
    result = judge(compiled, compiled.config, outcome(rows(True)), outcome(rows(True), metrics))
    assert [(p.probe, p.observed) for p in result.probes[1:]] == [
        (f"metrics.{key}", value)
        for key, value in zip(wanted, [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, None, None], strict=True)
    ]
    # A run that raised has no metrics at all: there is nothing to count, not zero.
    result = judge(compiled, compiled.config, outcome(rows(True)), outcome(None))
    assert {p.observed for p in result.probes[1:]} == {None}


def test_the_counters_are_those_the_runner_leaves_out_when_zero() -> None:
    from gym_resilience.metrics import batch_metrics
    from harness.judge.probes import is_counter

    empty = batch_metrics([], elapsed_s=0.0)  # no failure, no retry: only the keys that are always there
    assert not any(is_counter(key) for key in empty)
    assert [is_counter(key) for key in ("retries", "rollout_errors/cause/X", "rollout_errors/type/")] == [
        True,
        True,
        False,
    ]


def test_metrics_probes_with_a_user_pipeline_are_refused(tmp_path: Path) -> None:
    module = f"pipe_{secrets.token_hex(4)}"
    (tmp_path / f"{module}.py").write_text("async def run(tasks, env_factory, engine):\n    return []\n")
    text = (
        "title: pipeline\n"
        "batch: {env: word_game, tasks: 2}\n"
        f"pipeline: '{module}:run'\n"
        "probes:\n"
        "  - {probe: batch_size, eq: 2}\n"
        "  - {probe: metrics.rollout_errors, eq: 0}\n"
    )
    checked = check_text(text, file="p.yaml", folder=tmp_path)
    assert [str(problem) for problem in checked.problems] == [
        "p.yaml:6 at probes[1].probe: probe 'metrics.rollout_errors' reads BatchRunner's metrics, and a "
        "user pipeline runs instead, which gives none; remove pipeline to test BatchRunner, or probe the "
        "batch itself (batch_size, placeholders, envs_unclosed, ...)"
    ]
    without = text.replace(f"pipeline: '{module}:run'\n", "")
    assert check_text(without, file="p.yaml", folder=tmp_path).problems == ()


def test_the_documentation_names_every_counter_that_reads_zero() -> None:
    from harness.judge.probes import COUNTER_FAMILIES, COUNTERS

    docs = (Path(__file__).resolve().parents[3] / "docs" / "scenarios.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| `metrics.<key>` |"))
    assert all(f"`{name}`" in row for name in COUNTERS)
    assert all(f"`{family}<name>`" in row for family in COUNTER_FAMILIES)
