"""What the probes observe when a batch is unusual: a probe that cannot be computed for the batch observes
None (and says why) without costing the other probes, and a runner counter that is zero reads 0.0. Where
the attempts of a Ray run ran comes from the runner's attempt records, which the journal and the timeline
show too."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

from gym_resilience import AttemptRecord, Trajectory, TrajectoryId, build_batch_output
from harness.faults import Span
from harness.judge.probes import RunOutcome, attempt_nodes
from harness.judge.results import ClusterNode, RunJournal
from harness.judge.verdict import judge
from harness.reports import load_journal, write_journal
from harness.run.recorder import Recording
from harness.scenario.loader import check_text, parse_scenario


def outcome(trajectories: list[Trajectory] | None, metrics: dict[str, float] | None = None) -> RunOutcome:
    output = build_batch_output(trajectories) if trajectories is not None else None
    return RunOutcome(trajectories, output, metrics or {}, None, 1.0, Recording(envs_created=3))


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


# --- where the attempts of a Ray run ran: the runner's attempt records, not the spans -------------------

HEAD, W0, W1 = "aa" * 28, "b0" * 28, "b1" * 28


def attempt(rollout: int, number: int, node: str | None, error: str | None = None) -> AttemptRecord:
    phase = "reset" if error else "close"
    return AttemptRecord(rollout, number, node, phase, 0.5, error)  # type: ignore[arg-type]


def span(kind: str, rollout: int, number: int, start: float, node: str | None = None) -> Span:
    return Span(kind, rollout, number, None, start, start + 0.1, False, node)  # type: ignore[arg-type]


def ray_run(attempts: list[AttemptRecord], spans: list[Span]) -> RunOutcome:
    run = outcome(rows(True), {"rollouts": 3.0})
    run.attempts, run.recording, run.end_s, run.head_node = attempts, Recording(spans=spans), 5.0, HEAD
    run.nodes = [ClusterNode(HEAD, "head"), ClusterNode(W0, "worker 0", True), ClusterNode(W1, "worker 1")]
    return run


DIED = "EnvWorkerDiedError: env actor 1f on node b0b0 died during start: its node was removed"

# Rollout 1's first attempt died on worker 0 while its actor was starting, so no span of it logged a node
# (the reset span in the actor is the only one that does); its retry ran on worker 1.
FAULTED_ATTEMPTS = [
    attempt(0, 0, HEAD),
    attempt(1, 0, W0, DIED),
    attempt(1, 1, W1),
    attempt(2, 0, W1),
]
FAULTED_SPANS = [
    span("reset", 0, 0, 0.1, HEAD),
    span("generate", 0, 0, 0.3),
    span("generate", 1, 1, 1.0),  # attempt 1's reset span is missing too: the records decide
    span("reset", 2, 0, 0.2, W1),
    span("step", 2, 0, 0.6),
]


def test_a_retry_whose_first_attempt_never_reached_reset_counts_as_moved_by_its_attempt_records() -> None:
    compiled = scenario(
        "  - {probe: retries_moved_node, eq: 1}\n"
        "  - {probe: nodes_used, eq: 3}\n"
        "  - {probe: envs_on_head_node, eq: 1}\n"
    )
    baseline = ray_run([attempt(i, 0, W1) for i in range(3)], [])
    result = judge(compiled, compiled.config, baseline, ray_run(FAULTED_ATTEMPTS, FAULTED_SPANS))
    assert [(p.probe, p.observed) for p in result.probes[1:]] == [
        ("retries_moved_node", 1),
        ("nodes_used", 3),
        ("envs_on_head_node", 1),
    ]
    assert result.status == "held"


def test_a_node_only_a_span_names_is_not_an_attempts_node() -> None:
    compiled = scenario("  - {probe: nodes_used, eq: 0}\n")
    spans = [span("reset", 0, 0, 0.1, W0), span("reset", 0, 1, 0.5, W1)]
    faulted = ray_run([attempt(0, 0, None, DIED), attempt(0, 1, None)], spans)
    result = judge(compiled, compiled.config, ray_run([], []), faulted)
    assert [(p.probe, p.observed) for p in result.probes[1:]] == [("nodes_used", 0)]
    assert attempt_nodes(faulted.attempts) == {}


def test_the_journal_keeps_every_attempt_of_both_runs_the_clusters_nodes_and_each_calls_node(
    tmp_path: Path,
) -> None:
    compiled = scenario("  - {probe: retries_moved_node, gte: 1}\n")
    baseline = ray_run([attempt(i, 0, W1) for i in range(3)], [span("reset", 0, 0, 0.1, W1)])
    result = judge(compiled, compiled.config, baseline, ray_run(FAULTED_ATTEMPTS, FAULTED_SPANS))
    assert [(a.rollout, a.attempt, a.node, a.phase, a.error) for a in result.attempts] == [
        (0, 0, HEAD, "close", None),
        (1, 0, W0, "reset", DIED),
        (1, 1, W1, "close", None),
        (2, 0, W1, "close", None),
    ]
    assert {a.elapsed_s for a in result.attempts} == {0.5}
    assert [(a.rollout, a.node) for a in result.baseline_attempts] == [(0, W1), (1, W1), (2, W1)]
    assert [(n.role, n.removed) for n in result.nodes] == [
        ("head", False),
        ("worker 0", True),
        ("worker 1", False),
    ]
    calls = {(r.index, s.kind, s.attempt): s.node for r in result.rollouts for s in r.spans}
    # Every call carries the node of its attempt's env, generate included, from the attempt records.
    assert calls == {
        (0, "reset", 0): HEAD,
        (0, "generate", 0): HEAD,
        (1, "generate", 1): W1,
        (2, "reset", 0): W1,
        (2, "step", 0): W1,
    }
    assert [s.node for s in result.baseline_rollouts[0].spans] == [W1]
    journal = RunJournal(device="cpu", scenarios=[result])
    path = write_journal(journal, tmp_path / "journal.json")
    assert load_journal(path) == journal
    written = json.loads(path.read_text())["scenarios"][0]
    assert written["attempts"][1] == {
        "rollout": 1,
        "attempt": 0,
        "node": W0,
        "phase": "reset",
        "elapsed_s": 0.5,
        "error": DIED,
    }
    assert written["nodes"][1] == {"node": W0, "role": "worker 0", "removed": True}
    assert written["rollouts"][1]["spans"][0]["node"] == W1


def test_the_timeline_labels_each_rollout_with_the_node_of_every_attempt_and_strips_its_calls() -> None:
    from harness.reports.timeline import timeline_figure

    compiled = scenario("  - {probe: retries_moved_node, gte: 1}\n")
    result = judge(compiled, compiled.config, ray_run([], []), ray_run(FAULTED_ATTEMPTS, FAULTED_SPANS))
    figure = timeline_figure(result)
    figure.canvas.draw()
    (axes,) = figure.axes
    assert [label.get_text() for label in axes.get_yticklabels()] == ["r0 head", "r1 w0>w1", "r2 w1"]
    strips = sorted(str(a.get_gid()) for a in figure.findobj(lambda a: "node" in str(a.get_gid() or "")))
    # Attempt 0 of rollout 1 logged no call: its node is in the label, and it has no strip.
    assert strips == ["r0 attempt 0 node head", "r1 attempt 1 node w1", "r2 attempt 0 node w1"]
    (legend,) = figure.legends
    labels = [text.get_text() for text in legend.get_texts()]
    assert [label for label in labels if label.startswith("env on ")] == [
        "env on head",
        "env on w0: worker 0 (removed)",
        "env on w1: worker 1",
    ]
